"""The routed experts' W4A8 grouped GEMM on the interpreter: the nibble order (a swapped reading
fails), every e2m1 code at every scale code, experts without rows and rows outside every expert,
a call whose expert counts disagree, tilings, bitwise batch invariance, the whole MoE path from
router ids through the grouped list against per-token products of the checkpoint codec's weights,
and the model shapes it serves."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.dsl.errors import CallError
from duotile.kernels_spec import get
from duotile.kernels_spec import model_shapes as ms
from duotile.kernels_spec import moe_gemm_mxfp4 as mg
from duotile.kernels_spec.moe_permute import moe_permute_reference
from duotile.runtime import quant

SPEC = get("moe_gemm_mxfp4")
CPU = torch.device("cpu")
ARGS = ("a", "a_scale", "w", "w_scale", "counts", "offsets")


def run(case: dict, seed: int = 0, config: dict | None = None, inputs: dict | None = None) -> dict:
    x = inputs if inputs is not None else SPEC.make_inputs(case, CPU, seed)
    cfg = SPEC.config_of(case) if config is None else config
    codegen.compile(SPEC.kernel, "interpret", config=cfg, constants=SPEC.constants_of(case))(**x)
    return x


def off_elements(case: dict, x: dict, want: torch.Tensor) -> int:
    """How many elements of ``out`` lie beyond the spec's tolerance of ``want``."""
    got, want = x["out"].float(), want.float()
    allowed = SPEC.allowed_error(case, "out", want, x)
    return int((~(((got - want).abs() <= allowed) | (got == want))).sum())


def test_a_swapped_nibble_order_fails():
    """Each row reads one weight, and a byte's two codes never decode alike: the kernel matches the
    reference (the even element in the low nibble, model.md 1.4), and a reference reading the high
    nibble first is off in every element."""
    case = SPEC.cases["nibble_order"]
    x = run(case, seed=3)
    args = {k: x[k] for k in ARGS}
    assert off_elements(case, x, SPEC.run_reference(x, case)["out"]) == 0
    swapped = mg.moe_gemm_mxfp4_reference(**args, ABLOCK=32, high_first=True)["out"]
    assert off_elements(case, x, swapped) == x["out"].numel()


def test_experts_without_rows_read_nothing_and_uncovered_rows_are_untouched():
    """Experts without rows carry NaN scale codes (a block that read them would write NaN), and
    rows past offsets[E] keep what ``out`` held."""
    case = {"R": 30, "E": 7, "N": 32, "K": 128, "counts": "empty", "tail": 5}
    x = SPEC.make_inputs(case, CPU, 5)
    empty = x["counts"] == 0
    assert empty.any() and not empty.all()
    x["w_scale"][empty] = 255
    run(case, inputs=x, config={"BM": 16, "BN": 32, "BK": 64})
    total = int(x["offsets"][-1])
    assert total == 25 and bool(torch.isfinite(x["out"]).all())
    assert bool((x["out"][total:].float() == mg.UNWRITTEN).all())
    assert off_elements(case, x, SPEC.run_reference(x, case)["out"]) == 0


@pytest.mark.parametrize("rows,tiles_of", [(5, "one row each"), (12, "a short tile each")])
def test_the_grid_covers_the_most_row_tiles_a_routing_can_make(rows, tiles_of):
    """The grid runs ceil(R / BM) + min(R, E) row tiles: as many experts as rows, one row each (R
    tiles), or rows spread so that every expert's last tile is short (the bound's other term)."""
    case = {"R": rows, "E": 8, "N": 32, "K": 64, "ABLOCK": 32}
    x = SPEC.make_inputs(case, CPU, 2)
    counts = torch.zeros(8, dtype=torch.int32)
    if tiles_of == "one row each":
        counts[1:1 + rows] = 1
    else:
        counts[:] = torch.tensor([3, 1, 2, 1, 1, 2, 1, 1], dtype=torch.int32)
    x["counts"], x["offsets"] = counts, torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()])
    cfg = {"BM": 16, "BN": 32, "BK": 64}
    tiles = int(((counts + cfg["BM"] - 1) // cfg["BM"]).sum())
    assert tiles == -(-rows // cfg["BM"]) + min(rows, 8) - 1  # one short of the grid's bound
    run(case, inputs=x, config=cfg)
    assert off_elements(case, x, SPEC.run_reference(x, case)["out"]) == 0


def test_a_routing_of_another_expert_count_is_refused():
    case = {"R": 8, "E": 4, "N": 32, "K": 64}
    x = SPEC.make_inputs(case, CPU, 1)
    x["counts"] = x["counts"][:3]
    kernel = codegen.compile(SPEC.kernel, "interpret", config={"BM": 16, "BN": 32, "BK": 64})
    with pytest.raises(CallError, match=r"'counts' has E=3, but argument 'w' bound E=4|'w' has E=4, but "
                                        r"argument 'counts' bound E=3"):
        kernel(**x)


def test_steps_that_split_scale_blocks_are_refused_naming_the_line():
    with pytest.raises(dsl.DslError, match=r"moe_gemm_mxfp4\.py:\d+.*BK = 64 and ABLOCK = 96"):
        SPEC.kernel.trace(config={"BK": 64}, constants={"ABLOCK": 96})


@pytest.mark.parametrize("config", [{"BM": 16, "BN": 32, "BK": 32}, {"BM": 32, "BN": 128, "BK": 128},
                                    {"BM": 64, "BN": 64, "BK": 64}], ids=lambda c: "-".join(map(str, c.values())))
def test_tilings_agree_with_the_reference(config):
    """One ragged V4.1 problem (N = 88: a last column tile of 24 or 88 of 128) cut by steps as wide
    as and wider than the activation blocks, by row tiles of 16 to 64 and column tiles of 32 to 128."""
    case = {"R": 30, "E": 3, "N": 88, "K": 128, "ABLOCK": 32, "scales": "spread"}
    x = run(case, seed=7, config=config)
    assert off_elements(case, x, SPEC.run_reference(x, case)["out"]) == 0


def _sub_list(x: dict, expert: int, before: int) -> dict:
    """Expert ``expert``'s rows alone, after ``before`` rows of expert 0 (other positions in a tile)."""
    lo, n = int(x["offsets"][expert]), int(x["counts"][expert])
    rows = torch.cat([torch.arange(before), torch.arange(lo, lo + n)])
    counts = torch.zeros_like(x["counts"])
    counts[0], counts[expert] = before, n
    offsets = torch.zeros_like(x["offsets"])
    offsets[1:] = torch.cumsum(counts, 0)
    return {"a": x["a"][rows], "a_scale": x["a_scale"][rows], "w": x["w"], "w_scale": x["w_scale"],
            "counts": counts, "offsets": offsets, "out": torch.full((len(rows), x["out"].shape[1]), float("nan"),
                                                                    dtype=torch.bfloat16)}


def test_rows_are_bitwise_the_same_alone_and_in_a_batch():
    """A row's sum runs over the same K steps in the same order whatever R is and wherever the row
    sits in its tile (batch dimension R)."""
    case = {"R": 40, "E": 4, "N": 48, "K": 128, "counts": "uniform", "scales": "spread"}
    config = {"BM": 16, "BN": 32, "BK": 64}
    x = run(case, seed=9, config=config)
    lo, n = int(x["offsets"][2]), int(x["counts"][2])
    assert n > 1 and int(x["counts"][0]) >= 5
    for before in (0, 5):
        part = run({**case, "R": before + n}, config=config, inputs=_sub_list(x, 2, before))
        assert torch.equal(part["out"][before:], x["out"][lo:lo + n]), before


def test_the_moe_path_matches_per_token_products_of_the_checkpoint_codec():
    """Router ids -> moe_permute's grouped list -> the permuted FP8 activations (the activation
    quantiser's reference, 1 x 32 blocks) times the fused w1 / w3 weights of the checkpoint codec
    (quant.quantize_fp4_rows): each grouped row equals its token's activation times its expert's
    dequantised weights (quant.dequantize_fp4_rows), as the runtime's Expert computes them."""
    g = torch.Generator().manual_seed(11)
    t, e, top, d, width = 7, 5, 3, 96, 24
    ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(t)]).to(torch.int32)
    grouped = moe_permute_reference(ids, e)
    hidden = torch.randn(t, d, generator=g).to(torch.bfloat16)
    act = get("quantize").reference(hidden, BLOCK=32)
    w1, w3 = (torch.randn(e, width, d, generator=g) * 0.05 for _ in range(2))
    packed, scales = zip(*(quant.quantize_fp4_rows(torch.cat([w1[i], w3[i]])) for i in range(e)))
    token = grouped["order"].long() // top
    x = {"a": act["q"][token], "a_scale": act["scale"][token], "w": torch.stack(packed).view(torch.uint8),
         "w_scale": torch.stack(scales).view(torch.uint8), "counts": grouped["counts"], "offsets": grouped["offsets"],
         "out": torch.zeros(t * top, 2 * width, dtype=torch.bfloat16)}
    case = {"R": t * top, "E": e, "N": 2 * width, "K": d, "ABLOCK": 32}
    run(case, inputs=x, config={"BM": 16, "BN": 32, "BK": 32})
    xq = act["q"].double() * act["scale"].view(torch.float8_e8m0fnu).double().repeat_interleave(32, 1)
    assert torch.equal(xq.float(), quant.act_quant(hidden, 32))  # the runtime's activations
    ref = SPEC.run_reference(x, case)["out"]
    for q, p in enumerate(grouped["order"].tolist()):
        expert = int(ids.reshape(-1)[p])
        wd = quant.dequantize_fp4_rows(packed[expert], scales[expert]).double()
        want = (xq[p // top] @ wd.t()).to(torch.bfloat16)
        assert torch.equal(ref[q], want), q
    assert off_elements(case, x, ref) == 0


def test_the_model_shapes_are_both_grouped_gemms_of_both_models():
    shapes = SPEC.model_shapes
    assert len(shapes) == 16
    v4, v41 = shapes["v4/e256_w13/decode1"], shapes["v41/e384_w2/prefill4096"]
    assert {k: v4[k] for k in ("R", "E", "N", "K")} == {"R": 6, "E": 256, "N": 4096, "K": 4096}
    assert mg._ablock(v4) == 128 and mg._ablock(v41) == 32
    assert {k: v41[k] for k in ("R", "E", "N", "K")} == {"R": 6 * ms.PREFILL_CHUNK, "E": 384, "N": 5120, "K": 2304}
    assert shapes["v41/e384_w13/decode64"]["N"] == 2 * ms.V41_FLASH.moe_intermediate
    assert {c["R"] for c in shapes.values()} == {6, 96, 384, 6 * ms.PREFILL_CHUNK}
    assert SPEC.kernel.dynamic == ("R",) and SPEC.kernel.batch_dim == "R"


@pytest.mark.parametrize("shape", ["v4/e256_w13/decode1", "v41/e384_w13/decode16", "v41/e384_w2/prefill4096"])
def test_a_user_gets_the_measured_starting_config_on_sm90(shape, monkeypatch, tmp_path):
    """The cost model's narrow tiles measured 3x slower at V4.1's w13 (duotile/tuned/starting.json
    says by how much): every model shape gets the starting table's 64 x 128 x 128, three stages."""
    from duotile.codegen.choose_config import explain_choice

    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))  # no user tuning cache in the way
    case = SPEC.model_shapes[shape]
    sig = SPEC.kernel.bind(SPEC.meta_inputs(case))
    config, source, _ = explain_choice(SPEC.kernel, "sm90", sig, SPEC.constants_of(case))
    assert source == "starting"
    assert {k: config[k] for k in ("BM", "BN", "BK", "STAGES")} == {"BM": 64, "BN": 128, "BK": 128, "STAGES": 3}
