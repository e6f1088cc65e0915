"""The FP8 block-scaled GEMM on the interpreter: against its reference with the interpreter's own
(fp32) accumulation bound, at every test case, at seeded random cases and under pinned tilings;
bitwise batch invariance; the UE8M0 decode; the reference against the checkpoint codec; and the
model shapes it serves."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen, dsl
from duotile.kernels_spec import gemm_blockscaled as gb
from duotile.kernels_spec import get
from duotile.kernels_spec import model_shapes as ms
from duotile.runtime import quant

SPEC = get("gemm_blockscaled")
CPU = torch.device("cpu")


def run(case: dict, seed: int = 0, config: dict | None = None, inputs: dict | None = None) -> dict:
    x = inputs if inputs is not None else SPEC.make_inputs(case, CPU, seed)
    cfg = SPEC.config_of(case) if config is None else config
    codegen.compile(SPEC.kernel, "interpret", config=cfg, constants=SPEC.constants_of(case))(**x)
    return x


def interpreter_bound(case: dict, x: dict, want: torch.Tensor) -> torch.Tensor:
    """What the interpreter may be off by: one bf16 rounding apart, plus fp32 sums (exact products)
    of at most K terms, each rounding at most 2^-24 of the terms' magnitude so far."""
    mag = gb.magnitude(x, SPEC.constants_of(case)["BLOCK"]).float()
    return gb.RTOL * want.abs() + case["K"] * 2.0 ** -24 * mag + gb.ATOL


def check_tight(case: dict, x: dict) -> None:
    want = SPEC.run_reference(x, case)["c"].float()
    got = x["c"].float()
    err = (got - want).abs()
    bad = ~(err <= interpreter_bound(case, x, want))
    assert not bad.any(), f"{case}: {int(bad.sum())}/{bad.numel()} off, max error {err.max().item():.3g}"


@pytest.mark.parametrize("name", sorted(SPEC.cases))
def test_cases_match_the_reference_within_fp32_accumulation(name):
    case = SPEC.cases[name]
    check_tight(case, run(case, seed=2))


@pytest.mark.parametrize("seed", range(500, 506))
def test_random_cases_match_the_reference(seed):
    case = SPEC.random_case(random.Random(seed))
    check_tight(case, run(case, seed=seed))


# one V4.1 problem (K = 272: a ragged last 32-column block, N = 200 over 7 weight block rows)
# under tilings that cut it differently: steps shorter than, equal to and longer than a block,
# tiles within one block row and over several, one phase and split ranges, empty ones included
PINNED = [
    {"BM": 16, "BN": 32, "BK": 32, "SPLIT": 1},
    {"BM": 64, "BN": 64, "BK": 64, "SPLIT": 2},
    {"BM": 64, "BN": 128, "BK": 128, "SPLIT": 4},
    {"BM": 16, "BN": 192, "BK": 256, "SPLIT": 16},
]


@pytest.mark.parametrize("config", PINNED, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_pinned_tilings_agree_with_the_reference(config):
    case = {"M": 19, "N": 200, "K": 272, "BLOCK": 32, "scales": "spread"}
    check_tight(case, run(case, seed=7, config=config))


def test_a_tile_across_unaligned_v4_block_rows():
    """BN = 192 with 128-row weight blocks: every tile straddles two block rows, at offsets 0 and 64."""
    case = {"M": 5, "N": 400, "K": 256, "scales": "spread"}
    check_tight(case, run(case, seed=8, config={"BM": 16, "BN": 192, "BK": 128, "SPLIT": 2}))


@pytest.mark.parametrize("config", [{"BM": 16, "BN": 64, "BK": 64, "SPLIT": 4},
                                    {"BM": 64, "BN": 64, "BK": 128, "SPLIT": 1}])
def test_rows_are_bitwise_the_same_alone_and_in_a_batch(config):
    """A row's sum runs over the same K ranges in the same order whatever M is (batch_dim M)."""
    case = {"G": 2, "M": 21, "N": 72, "K": 208, "BLOCK": 32, "scales": "spread"}
    x = run(case, seed=9, config=config)
    full = x["c"].clone()
    for lo, hi in ((0, 1), (16, 21)):
        part = {"a": x["a"][:, lo:hi].contiguous(), "a_scale": x["a_scale"][:, lo:hi].contiguous(),
                "b": x["b"], "b_scale": x["b_scale"], "c": torch.full((2, hi - lo, 72), float("nan"),
                                                                        dtype=torch.bfloat16)}
        run({**case, "M": hi - lo}, config=config, inputs=part)
        assert torch.equal(part["c"], full[:, lo:hi]), (lo, hi)


def test_groups_are_independent_gemms():
    case = SPEC.cases["groups"]
    x = run(case, seed=3)
    for g in range(case["G"]):
        one = {k: v[g:g + 1] for k, v in x.items() if k != "c"}
        want = gb.gemm_blockscaled_reference(**one, BLOCK=32)["c"]
        assert torch.equal(x["c"][g:g + 1], want), g


@dsl.kernel
def decode_codes(codes: dsl.Tensor["N", dsl.u8], out: dsl.Tensor["N", dsl.f32]):
    for i in dsl.grid(dsl.cdiv(codes.N, 256)):
        dsl.store(out[i * 256], gb._pow2(dsl.load(codes[i * 256], (256,))))


def test_every_ue8m0_code_decodes_to_its_power_of_two():
    codes = torch.arange(256, dtype=torch.uint8)
    out = torch.zeros(256)
    codegen.compile(decode_codes, "interpret")(codes=codes, out=out)
    want = codes.view(torch.float8_e8m0fnu).float()
    assert torch.equal(out[:255], want[:255]) and out[0].item() == 2.0 ** -127 and out[254].item() == 2.0 ** 127
    assert torch.isnan(out[255]) and torch.isnan(want[255])


def test_a_nan_scale_code_makes_its_row_nan():
    case = {"M": 4, "N": 64, "K": 128, "BLOCK": 32}
    x = SPEC.make_inputs(case, CPU, 4)
    x["a_scale"][0, 2, 1] = 255  # row 2's second block: a non-finite activation block
    run(case, inputs=x, config={"BM": 16, "BN": 64, "BK": 64, "SPLIT": 2})
    assert bool(torch.isnan(x["c"][0, 2]).all()) and bool(torch.isfinite(x["c"][0, [0, 1, 3]]).all())


def test_steps_that_split_scale_blocks_are_refused_naming_the_line():
    with pytest.raises(dsl.DslError, match=r"gemm_blockscaled\.py:\d+.*BK = 64 and BLOCK = 96"):
        SPEC.kernel.trace(config={"BK": 64}, constants={"BLOCK": 96})


def test_the_reference_is_the_checkpoint_codecs_product():
    """Weights through the checkpoint codec (128 x 128 UE8M0 blocks), activations through the
    quantiser's reference: the block-scaled product is the product of the dequantised operands,
    and within the fp8 rounding of the bf16 product they stand for."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 384, generator=g).to(torch.bfloat16)
    w = (torch.randn(200, 384, generator=g) * 0.02).to(torch.bfloat16)
    wq, ws = quant.quantize_fp8_blocks(w.float(), 128)
    act = get("quantize").reference(x, BLOCK=128)
    c = gb.gemm_blockscaled_reference(act["q"][None], act["scale"][None], wq[None], ws.view(torch.uint8)[None],
                                      BLOCK=128)["c"][0].float()
    xd = act["q"].float() * act["scale"].view(torch.float8_e8m0fnu).float().repeat_interleave(128, 1)
    want = xd.double() @ quant.dequantize_fp8_blocks(wq, ws, 128).double().t()
    assert torch.allclose(c, want.float(), rtol=2 ** -7, atol=0)
    exact = x.double() @ w.double().t()
    assert (c - exact).abs().max() < 0.05 * exact.abs().max()


def test_the_model_shapes_are_both_models_fp8_projections():
    shapes = SPEC.model_shapes
    fp8 = {m.short: [n for n, (_, _, dt) in ms.dense_gemms(m).items() if dt == "f8e4m3"] for m in ms.MODELS.values()}
    assert {k.split("/")[1] for k in shapes if k.startswith("v4/")} == set(fp8["v4"])
    assert {k.split("/")[1] for k in shapes if k.startswith("v41/")} == set(fp8["v41"])
    assert len(shapes) == 4 * (len(fp8["v4"]) + len(fp8["v41"]))
    assert shapes["v4/wo_a/decode16"] == {"G": 8, "M": 16, "N": 1024, "K": 4096, "KB": 32, "NB": 8,
                                          "model": "v4-flash"}
    assert shapes["v41/wq_b/prefill4096"] == {"G": 1, "M": 4096, "N": 32768, "K": 1280, "KB": 40, "NB": 1024,
                                              "model": "v41-flash"}
    assert {c["M"] for c in shapes.values()} == {1, 16, 64, 4096}
    blocks = {m: {SPEC.constants_of(c)["BLOCK"] for c in SPEC.model_cases(m).values()} for m in ("v4", "v41")}
    assert blocks == {"v4": {128}, "v41": {32}}
    meta = SPEC.meta_inputs(shapes["v41/engram_proj/decode1"])  # scales at the model's block
    assert meta["a_scale"].shape == (1, 1, 192) and meta["b_scale"].shape == (1, 800, 192)
