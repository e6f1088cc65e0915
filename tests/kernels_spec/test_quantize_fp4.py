"""The FP4 activation quantisers (kernels_spec/quantize_fp4.py, MXFP4 and NVFP4-like) on the
interpreter, bit for bit: their reference over the spec's cases and a seeded random sweep, the
runtime's round trips and row codec (runtime/quant.py), the scales at their edges (UE8M0 at
powers of two, the floor and the f32 maximum; E4M3 at every value, every tie between neighbours,
the subnormals and the 448 clamp), e2m1 ties, the nibble order, NaN / Inf / zero blocks,
subnormal inputs, ragged widths, one build for every T; and the sm90 / sm100 builds (slow)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from duotile import codegen
from duotile.dsl.errors import DslError
from duotile.kernels_spec import load_all
from duotile.kernels_spec.quantize_fp4 import E4M3_VALUES, FORMATS
from duotile.runtime import quant

SPEC = load_all()["quantize_fp4"]
E4M3_ONE = 0x38  # 1.0 as an e4m3 byte


def run(x: torch.Tensor, fmt: str = "mxfp4", config: dict | None = None):
    t, d = x.shape
    q = torch.full((t, -(-d // 2)), 0xEE, dtype=torch.uint8)
    scale = torch.full((t, -(-d // FORMATS[fmt])), 0xEE, dtype=torch.uint8)
    codegen.compile(SPEC.kernel, "interpret", config=config, constants={"FORMAT": fmt})(x=x, q=q, scale=scale)
    return q, scale


def codes_of(q: torch.Tensor, d: int) -> torch.Tensor:
    return quant.unpack_fp4(q)[:, :d]


def scale_values(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    return scale.view(torch.float8_e8m0fnu if fmt == "mxfp4" else torch.float8_e4m3fn).float()


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str, d: int) -> torch.Tensor:
    s = scale_values(scale, fmt).repeat_interleave(FORMATS[fmt], 1)[:, :d]
    return quant.fp4_decode(codes_of(q, d)) * s


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_matches_the_reference_bit_for_bit(case_name):
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    want = SPEC.run_reference(inputs, case)
    assert torch.equal(inputs["q"], want["q"]) and torch.equal(inputs["scale"], want["scale"])
    assert not (inputs["scale"] == 0xEE).all()  # the kernel wrote its outputs


@pytest.mark.parametrize("seed", range(24))
def test_random_cases_match_the_reference_bit_for_bit(seed):
    case = SPEC.random_case(random.Random(7000 + seed))
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    want = SPEC.run_reference(inputs, case)
    assert torch.equal(inputs["q"], want["q"]) and torch.equal(inputs["scale"], want["scale"]), case


def test_the_cases_reach_the_edges_they_name():
    """Ties of e2m1 rounding in both directions, the scales' NaN, floor and largest codes, and
    subnormal inputs with nonzero codes, so the cases cannot pass by missing them."""
    def ref(name):
        case = SPEC.cases[name]
        inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
        return inputs["x"].float(), SPEC.run_reference(inputs, case)

    for fmt in FORMATS:
        x, want = ref(f"{fmt}_ties_f32")
        s = scale_values(want["scale"], fmt).repeat_interleave(FORMATS[fmt], 1)
        ratio = (x / s).abs()
        assert {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0} <= set(ratio.flatten().tolist())
        _, nonfinite = ref(f"{fmt}_nonfinite_f32")
        assert (nonfinite["scale"] == (255 if fmt == "mxfp4" else 0x7F)).any()
    _, scales = ref("mxfp4_scales_f32")
    assert {1, 253} <= set(scales["scale"].flatten().tolist())
    _, scales = ref("nvfp4_scales_f32")
    assert {1, 0x7E} <= set(scales["scale"].flatten().tolist())  # 2^-9 (the floor) and 448
    x, scales = ref("mxfp4_scales_f32")
    sub = (x.abs() < 2.0**-126) & (x != 0)
    assert ((codes_of(scales["q"], x.shape[1]) & 7) > 0)[sub].any()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantised_values_are_the_runtimes_round_trip(fmt, dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(9, 512, generator=g) * torch.exp2(torch.randint(-12, 12, (9, 1), generator=g).float())).to(dtype)
    q, scale = run(x, fmt)
    want = quant.mxfp4_round(x.float()) if fmt == "mxfp4" else quant.nvfp4_round(x.float())
    assert torch.equal(dequantize(q, scale, fmt, 512), want)


def test_mxfp4_bytes_are_the_runtimes_fp4_row_codec():
    """The checkpoint's MXFP4 layout (quant.quantize_fp4_rows): the same bytes and scale codes."""
    x = torch.randn(7, 256) * 30
    q, scale = run(x, "mxfp4")
    packed, codec_scale = quant.quantize_fp4_rows(x, 32)
    assert torch.equal(q, packed.view(torch.uint8)) and torch.equal(scale, codec_scale.view(torch.uint8))


def test_ue8m0_codes_at_powers_of_two_the_floor_and_the_f32_max():
    """amax = 6 x 2^k needs exactly 2^k (code 127 + k); one ulp above needs 2^(k + 1). The floor
    6 x 2^-126 gives 2^-126 (code 1), and so do zero rows and amax below it; the largest f32 gives
    2^126 (code 253)."""
    inf, zero = torch.tensor(float("inf")), torch.tensor(0.0)
    rows, want = [], []
    for k in (-120, -1, 0, 1, 7, 120):
        top = torch.tensor(6.0 * 2.0**k)
        rows += [top, torch.nextafter(top, inf), torch.nextafter(top, zero)]
        want += [127 + k, 128 + k, 127 + k]
    rows += [torch.tensor(v) for v in (0.0, quant.FP4_FLOOR, 2.0**-140, torch.finfo(torch.float32).max)]
    want += [1, 1, 1, 253]
    x = torch.zeros(len(rows), 32)
    x[:, 5] = -torch.stack(rows)  # the sign does not matter
    q, scale = run(x, "mxfp4")
    assert scale[:, 0].tolist() == want
    codes = codes_of(q, 32)
    assert (codes[:18:3, 5] == 8 | 7).all()  # -6 x 2^k / 2^k = -6, the largest code
    assert codes[-1, 5] == 8 | 6  # -3.4e38 / 2^126 = -3.99999976, rounded to -4


def test_e4m3_scale_at_every_value_tie_and_neighbour_is_torchs_rounding():
    """amax = 6 y hits y = amax / 6 exactly for every e4m3 value, every midpoint between two
    neighbours (a tie: to the even mantissa) and their f32 neighbours; below the floor, at the
    subnormal boundary and above 448 (clamped to 448)."""
    v = E4M3_VALUES
    mids = (v[:-1] + v[1:]) / 2
    ys = torch.cat([v, mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9)),
                    torch.tensor([2.0**-10, 2.0**-6, 448.0, 464.0, 480.0, 1e6])])
    amax = ys * 6.0
    assert torch.equal(amax[: 2 * len(v) - 1] / 6.0, ys[: 2 * len(v) - 1])  # the values and ties are exact
    x = torch.zeros(len(ys), 16)
    x[:, 3] = amax
    _, scale = run(x, "nvfp4")
    y = (amax.clamp(min=quant.NVFP4_FLOOR) / 6.0).clamp(max=448.0)
    assert torch.equal(scale[:, 0], y.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(scale[: len(v), 0], torch.arange(1, 127, dtype=torch.uint8))  # each value is its own byte
    tie = scale[len(v): 2 * len(v) - 1, 0]
    assert (tie % 2 == 0).all() and (tie == torch.arange(1, 126, dtype=torch.uint8) + 1).any()  # even, some up


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_e2m1_ties_go_to_the_even_code_and_zero_has_no_sign(fmt):
    """Block 0 has its max at 6 (scale 1): each midpoint and its negative. Block 1 has its max at
    7: scale 2 (UE8M0), or e4m3(7 / 6) = 1.125 (E4M3), whose quotients are no ties."""
    block = FORMATS[fmt]
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x = torch.zeros(1, 2 * block)
    x[0, :16] = torch.tensor([6.0] + mids + [-m for m in mids] + [-0.1])
    x[0, block: block + 7] = torch.tensor([0.1, -0.0, 0.0, -6.0, 1e-30, -7.0, 5.5])
    q, scale = run(x, fmt)
    codes = codes_of(q, 2 * block)[0]
    assert codes[:16].tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 0, 8 | 2, 8 | 2, 8 | 4, 8 | 4, 8 | 6, 8 | 6, 0]
    if fmt == "mxfp4":  # / 2: -3 -> -3, -3.5 a tie -> -4, 2.75 -> 3
        assert scale[0].tolist() == [127, 128]
        assert codes[block: block + 7].tolist() == [0, 0, 0, 8 | 5, 0, 8 | 6, 5]
    else:  # / 1.125: -5.33 -> -6, -6.22 -> -6, 4.89 -> 4
        assert scale[0].tolist() == [E4M3_ONE, E4M3_ONE + 1]
        assert codes[block: block + 7].tolist() == [0, 0, 0, 8 | 7, 0, 8 | 7, 6]


def test_nibble_order_low_is_the_even_channel():
    x = torch.zeros(2, 32)
    x[0, :4] = torch.tensor([0.5, 6.0, -1.0, 3.0])  # codes 1, 7, 8|2, 5
    x[1, :2] = torch.tensor([6.0, 0.0])
    q, _ = run(x, "mxfp4")
    assert q[0, :2].tolist() == [0x71, 0x5A] and q[1, 0] == 0x07


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_block_with_nan_or_inf_gets_the_scales_nan_and_zero_codes(fmt, dtype):
    block = FORMATS[fmt]
    x = (torch.randn(4, 3 * block) * 5).to(dtype)
    x[0, 5] = float("nan")
    x[1, block + 2] = float("inf")
    x[2, 2 * block + 1] = -float("inf")
    x[2, 2 * block + 2] = float("nan")
    q, scale = run(x, fmt)
    bad = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(scale == (255 if fmt == "mxfp4" else 0x7F), bad)
    codes = codes_of(q, 3 * block)
    every = bad.repeat_interleave(block, 1)
    assert (codes[every] == 0).all() and (codes[~every] != 0).any()
    deq = dequantize(q, scale, fmt, 3 * block)
    assert deq[every].isnan().all()
    finite = x.float().masked_fill(every, 0.0)
    want = quant.mxfp4_round(finite) if fmt == "mxfp4" else quant.nvfp4_round(finite)
    assert torch.equal(deq[~every], want[~every])


@pytest.mark.parametrize("fmt,floor_code", [("mxfp4", 1), ("nvfp4", 1)])
def test_zero_and_negative_zero_rows_sit_at_the_floor_with_code_zero(fmt, floor_code):
    x = torch.zeros(2, 64)
    x[1] = -0.0
    q, scale = run(x, fmt)
    assert (scale == floor_code).all() and (q == 0).all()  # 2^-126 / e4m3 2^-9; -0 is code 0


def test_subnormal_inputs_keep_their_codes():
    """Below the floor the scale is 2^-126, so subnormal inputs get nonzero codes (the kernel
    rebuilds them from their bits: a GPU built with ftz flushes them as float operands)."""
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([2.0**-127, -(2.0**-126) * 0.75, 2.0**-149, 3 * 2.0**-128])
    q, scale = run(x, "mxfp4")
    assert scale[0, 0] == 1
    assert codes_of(q, 32)[0, :4].tolist() == [1, 8 | 2, 0, 2]  # 0.5, -0.75 (a tie: up to -1), 2^-23, 0.75


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_ragged_widths_a_short_last_block_and_a_last_byte_of_one_nibble(fmt):
    block = FORMATS[fmt]
    d = 3 * block + 5  # a last block of 5 channels: an odd width
    x = torch.randn(3, d) * 10
    x[:, 3 * block:] *= 100  # the last block has its own larger scale
    q, scale = run(x, fmt)
    assert q.shape == (3, -(-d // 2)) and scale.shape == (3, 4)
    assert (q[:, -1] >> 4 == 0).all() and (q[:, -1] & 7 != 0).any()  # channel d - 1 alone in the last byte
    padded = torch.zeros(3, 4 * block)
    padded[:, :d] = x
    want = quant.mxfp4_round(padded) if fmt == "mxfp4" else quant.nvfp4_round(padded)
    assert torch.equal(dequantize(q, scale, fmt, d), want[:, :d])


def test_one_build_serves_every_token_count_and_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, 256, generator=g) * 3
    for fmt in FORMATS:
        kernel = codegen.compile(SPEC.kernel, "interpret", config={"ROWS": 8, "BLOCKS": 2}, constants={"FORMAT": fmt})
        outs = {}
        for t in (1, 5, 8, 37):
            q = torch.empty(t, 128, dtype=torch.uint8)
            s = torch.empty(t, 256 // FORMATS[fmt], dtype=torch.uint8)
            kernel(x=x[:t].contiguous(), q=q, scale=s)
            outs[t] = (q, s)
        for t, (q, s) in outs.items():
            assert torch.equal(q, outs[37][0][:t]) and torch.equal(s, outs[37][1][:t])


@pytest.mark.parametrize("config", [{"ROWS": 1, "BLOCKS": 1}, {"ROWS": 16, "BLOCKS": 4}, {"ROWS": 2, "BLOCKS": 8}])
def test_tunables_do_not_change_a_bit(config):
    x = (torch.randn(19, 650) * 1000).to(torch.bfloat16)
    for fmt in FORMATS:
        q0, s0 = run(x, fmt)
        q1, s1 = run(x, fmt, config)
        assert torch.equal(q0, q1) and torch.equal(s0, s1)


def test_model_shapes_are_the_index_queries_and_keys_and_v41s_compressed_rows():
    widths = {m: {(c["FORMAT"], c["D"]) for c in SPEC.model_cases(m).values()} for m in ("v4", "v41")}
    assert widths == {"v4": {("mxfp4", 8192), ("mxfp4", 128)},
                      "v41": {("mxfp4", 4096), ("mxfp4", 128), ("nvfp4", 512)}}
    rows = {(c["model"], c["FORMAT"], c["D"]): set() for c in SPEC.model_shapes.values()}
    for c in SPEC.model_shapes.values():
        rows[(c["model"], c["FORMAT"], c["D"])].add(c["T"])
    decode = {1, 16, 64}
    assert rows == {("v4-flash", "mxfp4", 8192): decode | {4096}, ("v4-flash", "mxfp4", 128): decode | {1024},
                    ("v41-flash", "mxfp4", 4096): decode | {4096}, ("v41-flash", "mxfp4", 128): decode | {2048, 4096},
                    ("v41-flash", "nvfp4", 512): decode | {2048, 4096}}
    for c in SPEC.model_shapes.values():  # shapes and dtypes only: what a build needs
        meta = SPEC.meta_inputs(c)
        assert meta["q"].shape == (c["T"], c["D"] // 2)
        assert meta["scale"].shape == (c["T"], c["D"] // FORMATS[c["FORMAT"]])


def test_an_unknown_format_is_refused():
    with pytest.raises(DslError, match="FORMAT"):
        SPEC.kernel.trace(constants={"FORMAT": "fp4"})


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target,shape", [("sm90", "v41/nvfp4_kv512/decode16"),
                                          ("sm100", "v4/mxfp4_index_q8192/prefill4096")])
def test_builds_at_model_shapes_with_ieee_division_and_no_log2(target, shape):
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import build_case

    r = build_case(SPEC, shape, SPEC.model_shapes[shape], target)
    assert r.ok, r.error
    ptx = r.artifact.stages["ptx"]
    assert r.artifact.files["cubin"].endswith(".cubin")
    assert "lg2" not in ptx and "ex2" not in ptx  # the scales come from exponent bits
    assert "div.approx" not in ptx and "div.full" not in ptx  # E4M3's quotient is torch's IEEE one
    if "nvfp4" in shape:
        assert "div.rn" in ptx
    else:
        assert "div." not in ptx  # UE8M0: a multiply by an exact power of two
    assert "T.Tensor((n_T, " in r.artifact.stages["tilelang"]  # one build serves every token count
