"""RMSNorm fused with the FP8 activation quantiser (kernels_spec/rmsnorm_quant.py) on the
interpreter, bit for bit: every case and seeded random shapes against the reference; the
reference against ``rmsnorm.py``'s and ``quantize.py``'s references composed, and against the
runtime's own norm and act_quant; NaN / Inf / overflowing rows; the scale codes where a power of
two must not round up; that a wrong rounding fails the byte check; clear errors for invalid
calls; one build for every token count, rows independent of the batch and of the tunables."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen
from duotile.dsl.errors import CallError, DslError
from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import check_outputs
from duotile.kernels_spec.quantize import quantize_reference
from duotile.kernels_spec.rmsnorm import rmsnorm_reference
from duotile.kernels_spec.rmsnorm_quant import rms_norm_rows
from duotile.runtime import quant
from duotile.runtime.layers.common import Ctx
from duotile.runtime.ops import FastOps

from .test_quantize import dequantize, same_bits

SPEC = load_all()["rmsnorm_quant"]


def run(x, w, block=128, eps=1e-6, config=None, y=None):
    """q and scale of rows ``x`` (the norm into ``y`` where it is given)."""
    t, d = x.shape
    q = torch.empty(t, d, dtype=torch.float8_e4m3fn)
    scale = torch.full((t, -(-d // block)), 7, dtype=torch.uint8)
    codegen.compile(SPEC.kernel, "interpret", config=config,
                    constants={"BLOCK": block, "EPS": eps})(x=x, weight=w, q=q, scale=scale, y=y)
    return q, scale


def float_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def bytes_match(case, seed) -> bool:
    """The kernel's bytes on ``case`` (q, scale and the norm y) against the reference's."""
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    args = {"x": inputs["x"], "weight": inputs["weight"], **SPEC.constants_of(case)}
    want = SPEC.reference(**args)
    return (same_bits(inputs["q"], want["q"]) and torch.equal(inputs["scale"], want["scale"])
            and torch.equal(float_bits(inputs["y"]), float_bits(want["y"])))


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_matches_the_reference_bit_for_bit(case_name):
    """test_interpret allows a GPU's one e4m3 step; the interpreter gives the reference's bytes."""
    assert bytes_match(SPEC.cases[case_name], seed=3)


@pytest.mark.parametrize("seed", range(4))
def test_seeded_random_cases_are_bit_exact(seed):
    assert bytes_match(SPEC.random_case(random.Random(100 + seed)), seed)


@pytest.mark.parametrize("d,block", [(4096, 128), (512, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_reference_is_rmsnorm_then_quantize_and_the_runtimes_path(d, block, dtype):
    """At a power-of-two width (no padding) the reference is ``rmsnorm_reference`` then
    ``quantize_reference`` bit for bit, and q x scale is the runtime's FFN input: its norm rounded
    to the activation dtype (``ctx.act``), then ``act_quant``; y is that norm (the router's input);
    leaving y out changes no bit of q and scale."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, d, generator=g) * 7).to(dtype)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(torch.bfloat16)
    want = SPEC.reference(x=x, weight=w, EPS=1e-6, BLOCK=block)
    composed = quantize_reference(rmsnorm_reference(x, w, 1e-6)["y"], block)
    assert same_bits(want["q"], composed["q"]) and torch.equal(want["scale"], composed["scale"])
    y = torch.empty_like(x)
    q, scale = run(x, w, block, y=y)
    assert same_bits(q, want["q"]) and torch.equal(scale, want["scale"])
    ctx = Ctx(ops=FastOps(), dtype=dtype)
    normed = ctx.act(ctx.ops.rms_norm(x, w, 1e-6))
    assert torch.equal(float_bits(y), float_bits(normed)) and torch.equal(y, rmsnorm_reference(x, w)["y"])
    assert torch.equal(dequantize(q, scale, block), quant.act_quant(normed.float(), block))
    q0, scale0 = run(x, w, block)
    assert same_bits(q0, q) and torch.equal(scale0, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_inf_rows(dtype):
    """A NaN anywhere makes the whole row NaN (every code 255); an Inf makes the rsqrt 0: its block
    NaN (Inf x 0), the row's other blocks zeros at the floor's code; squares that overflow make
    the whole row zeros; the other rows are untouched."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 384, generator=g)
    x[0, 17] = float("nan")
    x[1, 200] = float("inf")
    x[2, 300] = -float("inf")
    x[3] = torch.where(x[3] < 0, -1.0, 1.0) * 2.0 ** 70  # finite, squares past the f32 range
    x = x.to(dtype)
    w = (1 + 0.1 * torch.randn(384, generator=g)).to(torch.bfloat16)
    q, scale = run(x, w)
    want = SPEC.reference(x=x, weight=w)
    assert same_bits(q, want["q"]) and torch.equal(scale, want["scale"])
    assert (scale[0] == 255).all() and q[0].float().isnan().all()
    assert scale[1].tolist() == [105, 255, 105] and scale[2].tolist() == [105, 105, 255]
    assert q[1, 200].float().isnan() and q[2, 300].float().isnan()
    assert (q[1, :128].float() == 0).all() and (q[2, 256:300].float() == 0).all()
    assert q[2, 301:].float().isnan().sum() == 0
    assert scale[3].tolist() == [105] * 3 and (q[3].float() == 0).all()
    assert torch.equal(q[4].view(torch.uint8), run(x[4:].contiguous(), w)[0][0].view(torch.uint8))
    assert (scale[4] < 255).all() and (q[4].float() != 0).any()


def test_scale_codes_at_exact_powers_of_two_do_not_round_up():
    """Rows of +-1 normalise to themselves within a bf16 ulp, so y = w: a block whose largest
    weight is 448 x 2^k gets code 127 + k (the e4m3 values +-448), the next bf16 value above it
    128 + k; 2^k alone needs 2^(k - 8), code 119 + k, but under the floor (2^-20, 1e-4, 0) the
    floor's 105."""
    ks = [-20, -3, 0, 5, 30]
    tops = [448.0 * 2.0 ** k for k in ks] + [450.0 * 2.0 ** k for k in ks] + [2.0 ** k for k in ks] + [1e-4, 0.0]
    w = torch.full((len(tops) * 32,), 2.0 ** -30)
    for i, top in enumerate(tops):
        w[32 * i + 5] = -top
    x = torch.where(torch.randn(3, w.numel()) < 0, -1.0, 1.0).to(torch.bfloat16)
    q, scale = run(x, w.to(torch.bfloat16), block=32)
    want_codes = [127 + k for k in ks] + [128 + k for k in ks] + [max(119 + k, 105) for k in ks] + [105, 105]
    assert scale.tolist() == [want_codes] * 3
    assert (q[:, 5: 5 + 32 * len(ks): 32].float().abs() == 448.0).all()
    assert same_bits(q, SPEC.reference(x=x, weight=w.to(torch.bfloat16), BLOCK=32)["q"])


def naive_quantise(y: torch.Tensor, block: int, floor: float = 1e-4, scale: str = "ceil",
                   values: str = "nearest") -> dict:
    """model.md 2.10 / 4.1 written out with float64 logs (D a multiple of the block): the scale
    2^ceil(log2(amax / 448)) and the values rounded to the nearest e4m3, or a wrong rule:
    ``scale="floor+1"`` (2^(floor(log2) + 1): an exact power of two rounds up), ``values="toward_zero"``."""
    t, d = y.shape
    b = y.float().view(t, d // block, block)
    e = torch.log2(b.abs().amax(-1, keepdim=True).clamp(min=floor).double() / 448.0)
    code = torch.ceil(e) if scale == "ceil" else torch.floor(e) + 1
    v = (b.double() / torch.exp2(code)).float()
    q = v.to(torch.float8_e4m3fn)
    if values == "toward_zero":  # one e4m3 step back toward zero where nearest went past the value
        bits = q.view(torch.uint8)
        past = q.float().abs() > v.abs()
        q = torch.where(past, ((bits & 0x7F) - 1) | (bits & 0x80), bits).view(torch.float8_e4m3fn)
    return {"q": q.flatten(1), "scale": (code + 127).squeeze(-1).to(torch.uint8)}


@pytest.mark.parametrize("case,wrong", [
    ({"T": 6, "D": 512}, ("no_rounding_point", "toward_zero")),
    ({"T": 5, "D": 256, "values": "boundary"}, ("floor+1",)),  # maxima at 448 x 2^k
    ({"T": 4, "D": 384, "BLOCK": 32, "values": "floor"}, ()),
], ids=["normal", "boundary", "floor_b32"])
def test_model_md_written_out_agrees_and_a_wrong_rounding_is_caught(case, wrong):
    """The kernel's bytes are model.md's quantiser (float64 logs) of the bf16 norm; quantising the
    f32 norm (no rounding point), rounding values toward zero, or rounding a power-of-two scale up
    each gives other bytes (where the case's values can tell them apart)."""
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=2)
    consts = SPEC.constants_of(case)
    codegen.compile(SPEC.kernel, "interpret", constants=consts)(**inputs)
    x, w, block, eps = inputs["x"], inputs["weight"], consts["BLOCK"], consts["EPS"]

    def same(want):
        return same_bits(inputs["q"], want["q"]) and torch.equal(inputs["scale"], want["scale"])

    y = rms_norm_rows(x, w, eps)
    assert same(naive_quantise(y, block))
    variants = {"no_rounding_point": lambda: naive_quantise(rms_norm_rows(x.float(), w, eps), block),
                "toward_zero": lambda: naive_quantise(y, block, values="toward_zero"),
                "floor+1": lambda: naive_quantise(y, block, scale="floor+1")}
    for name in wrong:
        assert not same(variants[name]()), name


def test_a_scale_off_by_one_code_fails_the_registered_check_too():
    """test_interpret's tolerance allows a GPU's one e4m3 step in q, never a different code."""
    case = {"T": 5, "D": 256, "values": "boundary"}
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed=2)
    codegen.compile(SPEC.kernel, "interpret", constants=SPEC.constants_of(case))(**inputs)
    ref = SPEC.run_reference(inputs, case)
    check_outputs(SPEC, case, inputs, ref)
    wrong = {**ref, "scale": ref["scale"] + 1}
    with pytest.raises(AssertionError, match="rmsnorm_quant/scale"):
        check_outputs(SPEC, case, inputs, wrong)


def test_invalid_calls_give_clear_errors():
    x, w = torch.randn(3, 256).to(torch.bfloat16), torch.ones(256, dtype=torch.bfloat16)
    q, scale = torch.empty(3, 256, dtype=torch.float8_e4m3fn), torch.empty(3, 2, dtype=torch.uint8)
    kernel = codegen.compile(SPEC.kernel, "interpret")
    with pytest.raises(CallError, match=r"argument 'weight' has D=255, but argument 'x' bound D=256"):
        kernel(x=x, weight=w[:255], q=q, scale=scale)
    with pytest.raises(CallError, match=r"argument 'q' has dtype bf16, expected f8e4m3"):
        kernel(x=x, weight=w, q=x.clone(), scale=scale)
    with pytest.raises(CallError, match=r"argument 'scale' has dtype f32, expected u8"):
        kernel(x=x, weight=w, q=q, scale=scale.float())
    with pytest.raises(CallError, match=r"argument 'q' has T=2, but argument 'x' bound T=3"):
        kernel(x=x, weight=w, q=q[:2], scale=scale)
    with pytest.raises(DslError, match=r"BLOCK 0 must be a positive int"):
        SPEC.kernel.trace(constants={"BLOCK": 0})
    with pytest.raises(DslError, match=r"FLOOR 1000.0 out of range"):
        SPEC.kernel.trace(constants={"FLOOR": 1000.0})


def test_one_build_serves_every_token_count_and_tunables_change_no_bit():
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(19, 300, generator=g) * 3).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(300, generator=g)).to(torch.bfloat16)
    kernel = codegen.compile(SPEC.kernel, "interpret", config={"ROWS": 8, "SPLIT": 4}, constants={"BLOCK": 32})
    full_q, full_s = run(x, w, 32)
    for t in (1, 5, 19):
        q, s = torch.empty(t, 300, dtype=torch.float8_e4m3fn), torch.empty(t, 10, dtype=torch.uint8)
        kernel(x=x[:t].contiguous(), weight=w, q=q, scale=s)
        assert same_bits(q, full_q[:t]) and torch.equal(s, full_s[:t]), t
    assert len(kernel._cache) == 1
    for config in ({"ROWS": 1, "SPLIT": 1}, {"ROWS": 2, "SPLIT": 8}):
        q, s = run(x, w, 32, config=config)
        assert same_bits(q, full_q) and torch.equal(s, full_s), config


def test_model_shapes_are_the_hidden_norms_of_both_models():
    got = {m: {(c["D"], c["BLOCK"], c["NB"], c["EPS"]) for c in SPEC.model_cases(m).values()} for m in ("v4", "v41")}
    assert got == {"v4": {(4096, 128, 32, 1e-6)}, "v41": {(5120, 32, 160, 1e-20)}}
    assert {c["T"] for c in SPEC.model_shapes.values()} == {1, 16, 64, 4096}
    assert SPEC.constants_of(SPEC.model_shapes["v41/hidden/decode16"]) == {"BLOCK": 32, "EPS": 1e-20}
