"""The FP8 activation quantiser (kernels_spec/quantize.py) on the interpreter, bit for bit: its
reference, the runtime's own round trip (runtime/quant.act_quant), the UE8M0 codes at the edges
(exact powers of two, the floor, the largest values), non-finite blocks, ragged sizes and one
build serving every token count; and the sm90 / sm100 builds at a model shape (slow)."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen
from duotile.kernels_spec import load_all
from duotile.runtime import quant

SPEC = load_all()["quantize"]


def run(x: torch.Tensor, block: int = 128, config: dict | None = None):
    t, d = x.shape
    q = torch.empty(t, d, dtype=torch.float8_e4m3fn)
    scale = torch.full((t, -(-d // block)), 7, dtype=torch.uint8)
    codegen.compile(SPEC.kernel, "interpret", config=config, constants={"BLOCK": block})(x=x, q=q, scale=scale)
    return q, scale


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equality of e4m3 / uint8 tensors, a NaN of either sign matching any NaN."""
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    if got.dtype == torch.float8_e4m3fn:
        nan = got.float().isnan()
        if not torch.equal(nan, want.float().isnan()):
            return False
        g, w = g[~nan], w[~nan]
    return torch.equal(g, w)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    s = scale.view(torch.float8_e8m0fnu).float().repeat_interleave(block, 1)[:, : q.shape[1]]
    return q.float() * s


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_matches_the_reference_bit_for_bit(case_name):
    """test_interpret compares values; here the bytes, so -0 and +0 differ."""
    case = SPEC.cases[case_name]
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=3)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    want = SPEC.run_reference(inputs, case)
    assert same_bits(inputs["q"], want["q"]) and torch.equal(inputs["scale"], want["scale"])


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantised_values_are_the_runtimes_act_quant(block, dtype):
    """The runtime's simulated quantiser (the model's oracle) gives the same values as q x scale."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(9, 512, generator=g) * torch.exp2(torch.randint(-12, 12, (9, 1), generator=g).float())).to(dtype)
    q, scale = run(x, block)
    assert torch.equal(dequantize(q, scale, block), quant.act_quant(x.float(), block))


def test_scale_codes_at_exact_powers_of_two_do_not_round_up():
    """amax = 448 x 2^k needs exactly 2^k (code 127 + k); one ulp above needs 2^(k+1); the floor
    1e-4 gives 2^-22 (1e-4 / 448 = 2.2e-7 lies in (2^-23, 2^-22]); the largest f32 gives 2^120."""
    rows = []
    for k in (-20, -1, 0, 1, 7, 100):
        top = torch.tensor(448.0 * 2.0**k)
        rows += [top, torch.nextafter(top, torch.tensor(float("inf"))), torch.nextafter(top, torch.tensor(0.0))]
    rows += [torch.tensor(v) for v in (0.0, 1e-4, 2.0**-140, torch.finfo(torch.float32).max)]
    x = torch.zeros(len(rows), 128)
    x[:, 17] = -torch.stack(rows)  # the sign does not matter
    q, scale = run(x)
    codes = scale[:, 0].tolist()
    want = []
    for k in (-20, -1, 0, 1, 7, 100):
        want += [127 + k, 128 + k, 127 + k]
    want += [105, 105, 105, 247]
    assert codes == want
    assert torch.equal(q[:18:3, 17].float(), torch.full((6,), -448.0))  # 448 x 2^k / 2^k, exactly
    assert q[18, 17].float() == 0.0 and q[-1, 17].float() == -256.0  # 255.99... rounds to the e4m3 value 256


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_block_with_nan_or_inf_gets_code_255_and_q_is_x_times_zero(dtype):
    x = torch.randn(4, 384).to(dtype)
    x[0, 5] = float("nan")
    x[1, 130] = float("inf")
    x[2, 300] = -float("inf")
    x[2, 301] = float("nan")
    x[3, 0] = -0.0
    x[0, 6] = -1.0
    q, scale = run(x)
    bad = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
    assert torch.equal(scale == 255, bad)
    want = SPEC.reference(x=x, BLOCK=128)
    assert same_bits(q, want["q"]) and torch.equal(scale, want["scale"])
    assert q[0, 5].float().isnan() and q[1, 130].float().isnan() and q[2, 300].float().isnan()
    assert q[0, 6].view(torch.uint8) == 0x80 and q[0, 7].float() == 0.0  # x * 0 keeps the sign
    assert q[3, 0].view(torch.uint8) == 0x80  # -0 quantises to -0
    assert dequantize(q, scale, 128)[0, :128].isnan().all()  # code 255 is UE8M0's NaN
    fine = ~bad.repeat_interleave(128, 1)  # the other blocks are the runtime's values
    assert torch.equal(dequantize(q, scale, 128)[fine], quant.act_quant(x.float(), 128)[fine])


def test_a_short_last_block_covers_the_channels_that_exist():
    x = torch.randn(3, 200) * 10
    x[:, 192:] *= 100  # the last block (8 channels) has its own larger scale
    q, scale = run(x, 32)
    assert scale.shape == (3, 7)
    assert torch.equal(dequantize(q, scale, 32)[:, :192], quant.act_quant(x[:, :192], 32))
    assert torch.equal(scale, SPEC.reference(x=x, BLOCK=32)["scale"])


def test_one_build_serves_every_token_count_and_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, 256, generator=g) * 3
    kernel = codegen.compile(SPEC.kernel, "interpret", config={"ROWS": 8, "BLOCKS": 2})
    outs = {}
    for t in (1, 5, 8, 37):
        q = torch.empty(t, 256, dtype=torch.float8_e4m3fn)
        s = torch.empty(t, 2, dtype=torch.uint8)
        kernel(x=x[:t].contiguous(), q=q, scale=s)
        outs[t] = (q, s)
    for t, (q, s) in outs.items():
        assert same_bits(q, outs[37][0][:t]) and torch.equal(s, outs[37][1][:t])


@pytest.mark.parametrize("config", [{"ROWS": 1, "BLOCKS": 1}, {"ROWS": 16, "BLOCKS": 4}, {"ROWS": 2, "BLOCKS": 8}])
def test_tunables_do_not_change_a_bit(config):
    x = torch.randn(19, 640).to(torch.bfloat16) * 1000
    q0, s0 = run(x, 32)
    q1, s1 = run(x, 32, config)
    assert same_bits(q0, q1) and torch.equal(s0, s1)


def test_model_shapes_cover_every_fp8_gemm_input_width_at_the_models_blocks():
    widths = {m: {(c["D"], c["D"] // c["NB"]) for c in SPEC.model_cases(m).values()} for m in ("v4", "v41")}
    assert widths == {"v4": {(1024, 128), (2048, 128), (4096, 128), (8192, 128)},
                      "v41": {(1280, 32), (2304, 32), (4096, 32), (5120, 32), (6144, 32), (8192, 32)}}
    assert {c["T"] for c in SPEC.model_shapes.values()} == {1, 16, 64, 4096}


def test_a_floor_outside_the_code_range_is_refused():
    from duotile.dsl.errors import DslError

    with pytest.raises(DslError, match="FLOOR"):
        SPEC.kernel.trace(constants={"FLOOR": 1000.0})


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("shape", ["v4/k4096/prefill4096", "v41/k5120/decode16"])
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_builds_at_model_shapes_with_one_rounding_convert_and_no_log2(target, shape):
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import build_case

    r = build_case(SPEC, shape, SPEC.model_shapes[shape], target)
    assert r.ok, r.error
    ptx = r.artifact.stages["ptx"]
    assert r.artifact.files["cubin"].endswith(".cubin")
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # round to nearest even; a NaN stays NaN
    assert "lg2" not in ptx and "ex2" not in ptx  # the scale comes from exponent bits
    assert 'T.Tensor((n_T, ' in r.artifact.stages["tilelang"]  # one build serves every token count
