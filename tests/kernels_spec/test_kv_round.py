"""The cache formats' round trip (kernels_spec/kv_round.py: FP8 per 32 / 64, NVFP4-like, MXFP4) on
the interpreter, bit for bit (-0 apart from +0, a NaN for a NaN): the kernel against its reference
over the spec's cases, the reference against the runtime's quant.py round trips on random and edge
rows (FP8 with no floor down to f32's subnormals included), scales at their edges, e4m3 / e2m1
ties and zeros, NaN / Inf blocks, ragged widths, one build for every row count; the runtime's
kv_round op served by the kernel; and the sm90 / sm100 builds at model shapes (slow)."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen
from duotile.dsl.errors import DslError
from duotile.kernels_spec import load_all
from duotile.kernels_spec.kv_round import E4M3_GRID, REFERENCE_FLOORS
from duotile.kernels_spec.quantize_fp4 import FLOORS
from duotile.runtime import quant
from duotile.runtime.generated import GeneratedOps
from duotile.runtime.layers.common import Ctx, round_rows
from duotile.runtime.ops import FastOps

SPEC = load_all()["kv_round"]
# the runtime's formats: (kernel constants, quant.py's round trip)
FORMATS = {
    "fp8/32": ({"FORMAT": "fp8", "BLOCK": 32, "FLOOR": 0.0}, lambda x: quant.fp8_block_round(x, 32)),
    "fp8/64": ({"FORMAT": "fp8", "BLOCK": 64, "FLOOR": 0.0}, lambda x: quant.fp8_block_round(x, 64)),
    "nvfp4": ({"FORMAT": "nvfp4", "BLOCK": 16}, quant.nvfp4_round),
    "mxfp4": ({"FORMAT": "mxfp4", "BLOCK": 32}, quant.mxfp4_round),
}
KINDS = {"fp8": ("normal", "zeros", "pow2", "scales", "ties", "spread", "tiny", "huge", "nonfinite"),
         "fp4": ("normal", "zeros", "scales", "ties", "nibbles", "spread", "tiny", "huge", "nonfinite")}


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal f32 bits (so -0 differs from +0), a NaN of any payload matching a NaN."""
    nan = want.isnan()
    return (got.dtype == want.dtype == torch.float32 and torch.equal(got.isnan(), nan)
            and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)))


def run(x: torch.Tensor, constants: dict, config: dict | None = None) -> torch.Tensor:
    out = torch.full(x.shape, -7.0)
    codegen.compile(SPEC.kernel, "interpret", config=config, constants=constants)(x=x, out=out)
    return out


def reference(x: torch.Tensor, constants: dict) -> torch.Tensor:
    return SPEC.reference(x, **constants)["out"]


def rows_of(fmt: str, kind: str, t: int, d: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    case = {"T": t, "D": d, **FORMATS[fmt][0], "values": kind, "dtype": "f32" if dtype == torch.float32 else "bf16"}
    return SPEC.make_inputs(case, torch.device("cpu"), seed)["x"]


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_matches_the_reference_bit_for_bit(case_name):
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    assert same_bits(inputs["out"], SPEC.run_reference(inputs, case)["out"])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_reference_and_the_kernel_are_the_runtimes_round_trip(fmt, dtype):
    """Every kind of row (NaN / Inf blocks too) at a width of whole blocks: the reference is quant.py's
    round trip bit for bit, and so is the kernel."""
    constants, runtime = FORMATS[fmt]
    kinds = KINDS["fp8" if fmt.startswith("fp8") else "fp4"]
    for i, kind in enumerate(kinds):
        x = rows_of(fmt, kind, 6, 256, dtype, seed=10 + i)
        want = runtime(x.float())
        assert same_bits(reference(x, constants), want), kind
        assert same_bits(run(x, constants), want), kind


@pytest.mark.parametrize("block", [32, 64])
def test_fp8_with_no_floor_below_f32s_normals_is_the_runtimes(block):
    """FLOOR 0 (the cache rows'): blocks whose amax / 448 is an f32 subnormal (or 0) take the
    scale of the IEEE quotient on the subnormal grid, as quant.ue8m0_scale does; random amax bits
    from 0 to about 2^-100, the other values below, both signs."""
    g = torch.Generator().manual_seed(block)
    top = torch.randint(0, 0x0D800000, (300, 1), generator=g, dtype=torch.int64)
    bits = (top.double() * torch.rand(300, block, generator=g, dtype=torch.float64)).long()
    bits[:, 0] = top[:, 0]
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.where(torch.rand(300, block, generator=g) < 0.5, -x, x)
    constants = FORMATS[f"fp8/{block}"][0]
    want = quant.fp8_block_round(x, block)
    assert (want.abs() < 2.0**-126).any() and (want.abs() >= 2.0**-126).any() and (want != 0).float().mean() > 0.5
    assert same_bits(reference(x, constants), want) and same_bits(run(x, constants), want)


@pytest.mark.parametrize("block", [32, 64])
def test_fp8_with_the_activation_floor_is_the_runtimes_act_quant(block):
    x = rows_of(f"fp8/{block}", "tiny", 9, 256, seed=4)
    constants = {"FORMAT": "fp8", "BLOCK": block, "FLOOR": quant.FP8_ACT_FLOOR}
    want = quant.act_quant(x, block)
    assert same_bits(reference(x, constants), want) and same_bits(run(x, constants), want)
    assert not same_bits(want, quant.fp8_block_round(x, block))  # the floor binds on these rows


def test_fp8_scales_at_powers_of_two_round_trip_exactly_and_one_ulp_above_doubles():
    """amax = 448 x 2^k: s = 2^k, so the block's e4m3 grid points times 2^k come back unchanged
    (down to 448 x 2^-149, an f32 subnormal); one ulp above, amax comes back as 448 x 2^k: s =
    2^(k + 1) and the quotient 224 + 2^-21 rounds to 224, or (k = -149) amax / 448 rounds down to
    2^-149 on the subnormal grid and the quotient 449 clamps to 448."""
    ks = torch.tensor([-149.0, -140.0, -126.0, -20.0, 0.0, 7.0, 110.0])[:, None]
    picked = E4M3_GRID[torch.randint(0, 127, (len(ks), 64), generator=torch.Generator().manual_seed(1))]
    x = picked * torch.exp2(ks)
    x = torch.where(x / torch.exp2(ks) == picked, x, 0.0)  # the grid points f32 holds at 2^k
    x[:, 0] = 448.0 * torch.exp2(ks[:, 0])
    assert (x[0] != 0).sum() > 16 and (x[0].abs() < 2.0**-126).all()
    constants = FORMATS["fp8/64"][0]
    assert same_bits(run(x, constants), x) and same_bits(reference(x, constants), x)
    up = x.clone()
    up[:, 0] = torch.nextafter(x[:, 0], torch.tensor(float("inf")))
    got = run(up, constants)
    assert torch.equal(got[:, 0], x[:, 0]) and same_bits(got, quant.fp8_block_round(up, 64))
    assert (got[1:, 1:] != x[1:, 1:]).any()  # s doubled: some values lost their last bit


def test_fp8_blocks_whose_quotient_is_zero_keep_scale_one_and_round_to_signed_zeros():
    """amax / 448 <= 2^-150 rounds to 0 (a tie at 2^-150 goes to the even 0): s = 1, zeros; a
    quotient just above is 2^-149, and 448 x 2^-149 comes back as itself."""
    tie = 448.0 * 2.0**-150  # 7 x 2^-144, an f32 subnormal
    x = torch.zeros(3, 32)
    x[0, :3] = torch.tensor([tie, -tie / 2, 2.0**-149])
    x[1, :2] = torch.tensor([-torch.nextafter(torch.tensor(tie), torch.tensor(1.0)).item(), -2.0**-149])
    x[2, :2] = torch.tensor([448.0 * 2.0**-149, -(2.0**-149)])
    constants = FORMATS["fp8/32"][0]
    got = run(x, constants)
    assert same_bits(got, quant.fp8_block_round(x, 32))
    assert (got[0] == 0).all() and got.view(torch.int32)[0, 1] == -(2**31)  # -tie / 2 -> -0
    assert (got[1, 0] != 0) and got[2, 0] == 448.0 * 2.0**-149 and got[2, 1] == -(2.0**-149)


def test_e4m3_subnormals_ties_and_signed_zeros():
    """A block with max 448 (s = 1): e4m3's subnormal steps 2^-9 come back, 2^-10 (a tie between
    0 and 2^-9) goes to 0 and 3 x 2^-10 to 2^-8 (the even codes), with the sign; -0 stays -0."""
    x = torch.zeros(1, 32)
    x[0, :8] = torch.tensor([448.0, 2.0**-9, -5 * 2.0**-9, 2.0**-10, -(2.0**-10), 3 * 2.0**-10, -0.0, 2.0**-12])
    got = run(x, FORMATS["fp8/32"][0])
    assert got[0, :8].tolist() == [448.0, 2.0**-9, -5 * 2.0**-9, 0.0, -0.0, 2.0**-8, -0.0, 0.0]
    bits = got.view(torch.int32)[0]
    assert bits[[4, 6]].tolist() == [-(2**31)] * 2 and bits[[3, 7]].tolist() == [0, 0]
    assert same_bits(got, quant.fp8_block_round(x, 32))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_e2m1_ties_go_to_the_even_code_and_zeros_have_no_sign(fmt):
    """max 6 (s = 1 in both formats): each midpoint and its negative, values under 0.25 and -0."""
    block = FORMATS[fmt][0]["BLOCK"]
    x = torch.zeros(1, 2 * block)
    x[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, -0.1, -0.0,
                              0.2500001, 5.9])
    got = run(x, FORMATS[fmt][0])
    assert got[0, :16].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -2.0, -4.0, 0.0, 0.0,
                                    0.5, 6.0]
    assert (got.view(torch.int32)[0, [8, 12, 13]] == 0).all() and (got[0, 16:] == 0).all()  # +0, never -0
    assert same_bits(got, FORMATS[fmt][1](x))


def test_mxfp4_at_the_floor_gives_f32_subnormals():
    """Below the floor 6 x 2^-126 the scale is 2^-126, so 0.5 x 2^-126 = 2^-127 comes back as an f32
    subnormal (built from bits: a target built with ftz would flush a product)."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([2.0**-127, -(2.0**-126) * 0.75, 2.0**-149, 3 * 2.0**-128])
    got = run(x, FORMATS["mxfp4"][0])
    assert got[0, :4].tolist() == [2.0**-127, -(2.0**-126), 0.0, 2.0**-126]  # 0.5, -0.75 -> -1, 2^-23, 0.75
    assert same_bits(got, quant.mxfp4_round(x))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_nan_and_inf_blocks(fmt):
    """A NaN makes its block NaN; an Inf too in the UE8M0 formats, but NVFP4's scale clamps to 448:
    the Inf is +-2688 and its block rounds at 448. The other blocks are their own round trip."""
    constants, runtime = FORMATS[fmt]
    block = constants["BLOCK"]
    x = torch.randn(4, 3 * block, generator=torch.Generator().manual_seed(2)) * 300
    x[0, 5] = float("nan")
    x[1, block + 2] = float("inf")
    x[2, 2 * block + 1] = -float("inf")
    x[2, 2 * block + 2] = float("nan")
    x[3, 1] = -float("inf")
    got = run(x, constants)
    assert same_bits(got, runtime(x)) and same_bits(reference(x, constants), got)
    nan_blocks = got.isnan().view(4, 3, block)
    assert (nan_blocks.all(-1) == nan_blocks.any(-1)).all()  # a block is NaN throughout or not at all
    if fmt == "nvfp4":
        assert nan_blocks.any(-1).tolist() == [[True, False, False], [False, False, False], [False, False, True],
                                               [False, False, False]]
        assert got[1, block + 2] == 6 * 448.0 and got[3, 1] == -6 * 448.0
        assert torch.equal(got[1, block:2 * block], 448.0 * quant.fp4_round(x[1, block:2 * block] / 448.0))
    else:
        assert nan_blocks.any(-1).tolist() == [[True, False, False], [False, True, False], [False, False, True],
                                               [True, False, False]]
    clean = x.isfinite().view(4, 3, block).all(-1).repeat_interleave(block, 1)  # blocks of finite values
    assert clean.any() and same_bits(got[clean], runtime(torch.where(clean, x, 0.0))[clean])


@pytest.mark.parametrize("fmt", ["fp8/32", "mxfp4"])
def test_blocks_near_the_f32_maximum_round_up_to_inf(fmt):
    """f32's largest value: its UE8M0 scale is 2^120 (FP8) / 2^126 (MXFP4), its quotient 255.99 /
    3.99 rounds to 256 / 4, and 2^128 is past f32's range: +-Inf, as quant.py gives."""
    big = torch.finfo(torch.float32).max
    x = torch.zeros(2, 32)
    x[0, 0], x[1, 0], x[1, 1] = big, -big, 1.0
    got = run(x, FORMATS[fmt][0])
    assert got[0, 0] == float("inf") and got[1, 0] == -float("inf") and got[1, 1] == 0.0
    assert same_bits(got, FORMATS[fmt][1](x))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_ragged_widths_round_the_last_block_as_if_padded_with_zeros(fmt):
    constants, runtime = FORMATS[fmt]
    block = constants["BLOCK"]
    d = 3 * block + 5
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(8)) * 10
    x[:, 3 * block:] *= 100  # the last block has its own larger scale
    padded = torch.zeros(3, 4 * block)
    padded[:, :d] = x
    got = run(x, constants, {"ROWS": 2, "BLOCKS": 4})
    assert got.shape == (3, d) and same_bits(got, runtime(padded)[:, :d].contiguous())


def test_the_cases_reach_the_edges_they_name():
    """So that the cases cannot pass by missing what they are for: FP8 scales below 2^-126 and
    subnormal outputs (tiny), e4m3 subnormal quotients and zeros (spread), Inf outputs (huge),
    NaN blocks (nonfinite) and NVFP4 blocks with an Inf but no NaN, exact e4m3 / e2m1 ties."""
    def ref(name):
        case = SPEC.cases[name]
        inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
        return inputs["x"].float(), SPEC.run_reference(inputs, case)["out"]

    x, out = ref("fp8_b64_tiny_f32")
    assert ((out != 0) & (out.abs() < 2.0**-126)).any()
    x, out = ref("fp8_b64_spread_f32")
    s = torch.exp2(torch.ceil(torch.log2(x.view(6, -1, 64).abs().amax(-1, keepdim=True) / 448)))
    y = (x.view(6, -1, 64) / s).abs()
    assert ((y > 0) & (y < 2.0**-6) & (out.view(6, -1, 64) != 0)).any() and ((y > 0) & (out.view(6, -1, 64) == 0)).any()
    for name in ("fp8_b64_huge_f32", "mxfp4_huge_f32"):
        assert ref(name)[1].isinf().any(), name
    for name in ("fp8_b32_nonfinite_f32", "mxfp4_nonfinite_f32", "nvfp4_nonfinite_f32"):
        assert ref(name)[1].isnan().any(), name
    x, out = ref("nvfp4_nonfinite_f32")
    blocks, got = x.view(7, -1, 16), out.view(7, -1, 16)
    inf_only = blocks.isinf().any(-1) & ~blocks.isnan().any(-1)
    assert inf_only.any() and got[inf_only].isfinite().all()
    x, _ = ref("fp8_b32_ties_f32")  # each block's max is 448 s for its exact scale s
    y = x.view(8, -1, 32) / (x.view(8, -1, 32).abs().amax(-1, keepdim=True) / 448)
    assert torch.isin(y.abs(), (E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2).any()
    for fmt in ("mxfp4", "nvfp4"):  # each block's max is 6 s for its scale s (a power of two / an e4m3 value)
        block = FORMATS[fmt][0]["BLOCK"]
        x, _ = ref(f"{fmt}_ties_f32")
        y = x.view(8, -1, block) / (x.view(8, -1, block).abs().amax(-1, keepdim=True) / 6)
        assert torch.isin(y.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).sum() > 50, fmt


def test_one_build_serves_every_row_count_and_rows_do_not_depend_on_the_batch():
    x = rows_of("fp8/64", "spread", 37, 448, seed=9)
    for fmt, (constants, _) in FORMATS.items():
        kernel = codegen.compile(SPEC.kernel, "interpret", config={"ROWS": 8, "BLOCKS": 2}, constants=constants)
        outs = {}
        for t in (1, 5, 8, 37):
            outs[t] = torch.empty(t, 448)
            kernel(x=x[:t].contiguous(), out=outs[t])
        assert len(kernel._cache) == 1, fmt
        for t, out in outs.items():
            assert same_bits(out, outs[37][:t]), (fmt, t)


@pytest.mark.parametrize("config", [{"ROWS": 1, "BLOCKS": 1}, {"ROWS": 16, "BLOCKS": 4}, {"ROWS": 2, "BLOCKS": 8}])
def test_tunables_do_not_change_a_bit(config):
    x = (torch.randn(19, 650, generator=torch.Generator().manual_seed(6)) * 1000).to(torch.bfloat16)
    for constants, _ in FORMATS.values():  # 650 channels: a short last block in every format
        assert same_bits(run(x, constants, config), run(x, constants)), (constants, config)


def test_model_shapes_are_the_rows_the_runtime_rounds():
    kinds = {}
    for key, c in SPEC.model_shapes.items():
        what = (c["model"], c["FORMAT"], c.get("BLOCK"), c["D"], c.get("dtype", "bf16"), key.split("/")[1])
        kinds.setdefault(what, set()).add(c["T"])
    decode = {1, 16, 64}
    assert kinds == {
        ("v4-flash", "fp8", 64, 448, "bf16", "window_fp8_64_d448"): decode | {4096},
        ("v4-flash", "fp8", 64, 448, "bf16", "comp_fp8_64_d448"): {1, 1024, 32},
        ("v4-flash", "mxfp4", None, 128, "f32", "index_k_mxfp4_d128"): {1, 1024},
        ("v4-flash", "mxfp4", None, 128, "f32", "index_q_mxfp4_h64_d128"): {64, 1024, 4096, 4096 * 64},
        ("v41-flash", "fp8", 32, 512, "bf16", "window_fp8_32_d512"): decode | {4096},
        ("v41-flash", "nvfp4", None, 512, "bf16", "comp_nvfp4_d512"): {1, 2048, 4096},
        ("v41-flash", "mxfp4", None, 128, "bf16", "index_k_mxfp4_d128"): {1, 2048, 4096},
        ("v41-flash", "mxfp4", None, 128, "bf16", "index_q_mxfp4_h32_d128"): {32, 512, 2048, 4096 * 32},
    }
    for c in SPEC.model_shapes.values():
        meta = SPEC.meta_inputs(c)
        assert meta["x"].shape == meta["out"].shape == (c["T"], c["D"]) and meta["out"].dtype == torch.float32


def test_the_references_floors_are_the_kernels():
    assert REFERENCE_FLOORS == FLOORS


@pytest.mark.parametrize("constants,match", [({"FORMAT": "fp4"}, "FORMAT"), ({"FORMAT": "fp8", "BLOCK": 128}, "BLOCK"),
                                             ({"FORMAT": "nvfp4", "BLOCK": 32}, "16 channels"),
                                             ({"FORMAT": "fp8", "BLOCK": 32, "FLOOR": -1.0}, "FLOOR"),
                                             ({"FORMAT": "mxfp4", "BLOCK": 32, "FLOOR": 1e-4}, "own floor")])
def test_unknown_formats_blocks_and_floors_are_refused(constants, match):
    with pytest.raises(DslError, match=match):
        SPEC.kernel.trace(constants=constants)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_kv_round_op_runs_the_kernel_bit_for_bit(fmt):
    """GeneratedOps serves the runtime's op on any leading dims (a strided slice too, as V4's nope
    channels are), BF16 or FP32, FP32 out; no rows without a launch; a width of no whole blocks
    stays on the reference."""
    ops = GeneratedOps(FastOps())
    ctx = Ctx(ops)
    g = torch.Generator().manual_seed(3)
    heads = (torch.randn(3, 4, 128, generator=g) * 5).to(torch.bfloat16)
    wide = torch.randn(5, 512, generator=g) * torch.exp2(torch.randint(-20, 20, (5, 1), generator=g).float())
    for t in (heads, wide, wide[:, :448], heads[:0]):
        want = round_rows.__wrapped__(ctx, t, fmt)
        got = round_rows(ctx, t, fmt)
        assert got.shape == t.shape and same_bits(got, want), (fmt, tuple(t.shape))
    assert ctx.tally.snapshot() == {"kv_round": (4, 0)}
    assert ops._serves["kv_round"](ctx, wide[:, :40], fmt) is NotImplemented
    (kernel,) = ops._kernels.values()
    assert len(kernel._cache) == 3  # one a dtype and width (BF16 x 128, FP32 x 512 and x 448), any row count


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target,shape", [("sm90", "v41/window_fp8_32_d512/decode16"),
                                          ("sm100", "v41/comp_nvfp4_d512/decode1"),
                                          ("sm100", "v4/index_q_mxfp4_h64_d128/decode16")])
def test_builds_at_model_shapes_from_bits_with_ieee_division_only_for_nvfp4(target, shape):
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import build_case

    r = build_case(SPEC, shape, SPEC.model_shapes[shape], target)
    assert r.ok, r.error
    ptx = r.artifact.stages["ptx"]
    assert r.artifact.files["cubin"].endswith(".cubin")
    assert "lg2" not in ptx and "ex2" not in ptx  # scales and products from exponent bits
    assert "div.approx" not in ptx and "div.full" not in ptx
    if "nvfp4" in shape:
        assert "div.rn" in ptx  # amax / 6 and x / s: torch's IEEE quotients
    else:
        assert "div.rn" not in ptx  # UE8M0: exponents moved on bits (FP8's grid count: an integer division)
    assert "T.Tensor((n_T, " in r.artifact.stages["tilelang"]  # one build serves every row count
