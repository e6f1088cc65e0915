"""The experts' clamped SwiGLU fused with the FP8 activation quantiser (kernels_spec/swiglu_quant.py)
on the interpreter, bit for bit: every case and seeded random shapes against the reference; q x
scale against the runtime's own ``Expert`` (what its ``w2`` quantises); the clamps at and past
the limit, Inf and NaN; the routing weight; that a wrong rounding fails the byte check; clear
errors for invalid calls; one build for every row count of a power-of-two bucket, rows independent
of the batch and of the tunables."""

from __future__ import annotations

import random

import pytest
import torch

from duotile import codegen
from duotile.dsl.errors import CallError, DslError
from duotile.kernels_spec import load_all
from duotile.kernels_spec.compare import check_outputs
from duotile.kernels_spec.quantize import quantize_reference
from duotile.runtime import quant
from duotile.runtime.layers.common import Ctx, Linear
from duotile.runtime.layers.moe import Expert
from duotile.runtime.ops import FastOps, InvariantOps

from .test_quantize import dequantize, same_bits
from .test_rmsnorm_quant import naive_quantise

SPEC = load_all()["swiglu_quant"]


def run(h, weight=None, block=128, config=None):
    """The kernel on ``h``: the fused rows [T, 2I], or their halves [T, 2, I] (flattened here)."""
    h = h.flatten(1)
    t, i = h.shape[0], h.shape[1] // 2
    q = torch.empty(t, i, dtype=torch.float8_e4m3fn)
    scale = torch.full((t, -(-i // block)), 7, dtype=torch.uint8)
    kernel = codegen.compile(SPEC.kernel, "interpret", config=config, constants={"BLOCK": block})
    kernel(h=h, q=q, scale=scale, weight=weight)
    return q, scale


def kernel_bytes(case, seed):
    inputs = SPEC.make_inputs(case, torch.device("cpu"), seed)
    codegen.compile(SPEC.kernel, "interpret", config=SPEC.config_of(case), constants=SPEC.constants_of(case))(**inputs)
    return inputs


def matches(inputs, want) -> bool:
    return same_bits(inputs["q"], want["q"]) and torch.equal(inputs["scale"], want["scale"])


@pytest.mark.parametrize("case_name", sorted(SPEC.cases))
def test_every_case_matches_the_reference_bit_for_bit(case_name):
    """test_interpret allows a GPU's one e4m3 step; the interpreter gives the reference's bytes."""
    case = SPEC.cases[case_name]
    inputs = kernel_bytes(case, seed=3)
    assert matches(inputs, SPEC.run_reference(inputs, case))


@pytest.mark.parametrize("seed", range(4))
def test_seeded_random_cases_are_bit_exact(seed):
    case = SPEC.random_case(random.Random(200 + seed))
    inputs = kernel_bytes(case, seed)
    assert matches(inputs, SPEC.run_reference(inputs, case)), case


class _Capture:
    """Stands in for an expert's ``w2``: keeps the activation it is given (its quantiser's input)."""

    def __call__(self, ctx, x):
        self.x = x
        return torch.zeros(x.shape[0], 1)


@pytest.mark.parametrize("ops,dtype,weighted",
                         [(FastOps(), torch.bfloat16, True), (InvariantOps(), torch.float32, False)],
                         ids=["routed_bf16_fast", "shared_f32_invariant"])
def test_dequantised_values_are_what_the_runtimes_w2_quantises(ops, dtype, weighted):
    """runtime/layers/moe.Expert: gate and up from w1 / w3 (the fused GEMM's two halves, h[:, :I]
    and h[:, I:]), its clamped SwiGLU times the weight, rounded by ``ctx.act``, then ``act_quant``
    in w2's Linear: q x scale gives those values."""
    g = torch.Generator().manual_seed(11)
    t, d, i = 10, 64, 384
    ctx = Ctx(ops=ops, dtype=dtype)
    xq = torch.randn(t, d, generator=g)
    w1, w3 = torch.randn(i, d, generator=g) * 0.3, torch.randn(i, d, generator=g) * 0.3
    weight = torch.rand(t, generator=g) if weighted else None
    w2 = _Capture()
    Expert(Linear(w1, None), Linear(w3, None), w2, 10.0)(ctx, xq, weight)
    gate, up = ctx.act(ctx.ops.linear(xq, w1)), ctx.act(ctx.ops.linear(xq, w3))
    h = torch.cat([gate, up], 1)  # the fused [T, 2I] rows
    for block in (32, 128):
        q, scale = run(h, weight, block)
        assert torch.equal(dequantize(q, scale, block), quant.act_quant(w2.x.float(), block)), block


def test_clamps_at_and_past_the_limit_inf_and_nan():
    """up in [-10, 10] and gate <= 10 by comparisons: a gate past 10 (+Inf too) acts as 10, up past
    +-10 (+-Inf too) as +-10; a very negative gate gives silu -0; -Inf gate gives silu NaN
    (-Inf / Inf) and a NaN stays NaN: code 255 for the block, q = a x 0 in it; the row's other
    block is untouched."""
    inf, nan = float("inf"), float("nan")
    gate = torch.tensor([10.0, 10.5, 1e30, inf, -1e30, 2.0, 2.0, 2.0, -inf, nan, 1.0])
    up = torch.tensor([1.0, 1.0, 1.0, 1.0, 3.0, 10.0, -10.25, -inf, 1.0, 1.0, nan])
    h = torch.ones(gate.numel(), 2, 64)
    h[:, 0, 3], h[:, 1, 3] = gate, up
    q, scale = run(h, block=32)
    want = SPEC.reference(h=h.flatten(1), BLOCK=32)
    assert same_bits(q, want["q"]) and torch.equal(scale, want["scale"])
    bits = q.view(torch.uint8)
    assert all(torch.equal(bits[r], bits[0]) for r in (1, 2, 3)) and torch.equal(scale[1:4], scale[0:1].expand(3, 2))
    assert bits[4, 3] == 0x80  # silu(-1e30) = -0
    assert bits[6, 3] == bits[5, 3] | 0x80 and bits[7, 3] == bits[6, 3]  # -10.25 and -Inf act as -10
    assert (scale[:8, 0] < 255).all() and (scale[8:, 0] == 255).all()
    assert q[8:, 3].float().isnan().all() and (bits[8:, 4:32] == 0).all()  # a x 0 = +0 beside the NaN
    assert (scale[:, 1] == scale[0, 1]).all() and (bits[:, 32:] == bits[0, 32:]).all()


def test_the_routing_weight_scales_each_row_and_zero_gives_the_floor():
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(6, 2, 256, generator=g) * 3).to(torch.bfloat16)
    weight = torch.tensor([1.0, 0.5, 0.0, 2.0 ** -20, 1.5, 0.25])
    q, scale = run(h, weight)
    want = SPEC.reference(h=h.flatten(1), weight=weight)
    assert same_bits(q, want["q"]) and torch.equal(scale, want["scale"])
    q1, s1 = run(h)
    assert same_bits(q[0], q1[0]) and torch.equal(scale[0], s1[0])  # weight 1: unweighted
    assert torch.equal(q[1].view(torch.uint8), q1[1].view(torch.uint8)) and torch.equal(scale[1], s1[1] - 1)
    assert (scale[2:4] == 105).all() and (q[2].float() == 0).all()  # under the floor


def _product(h, weight, rounded=True, weighted=True):
    """model.md 2.6 in f32: silu(min(gate, 10)) x clamp(up, -10, 10) x weight, rounded to h's dtype
    (h: the fused rows [T, 2I])."""
    i = h.shape[1] // 2
    g, u = h[:, :i].float().clamp(max=10.0), h[:, i:].float().clamp(-10.0, 10.0)
    a = g / (1 + torch.exp(-g)) * u
    a = a * weight[:, None] if weighted else a
    return a.to(h.dtype) if rounded else a


def _wrong(h, weight, rule, BLOCK=128, FLOOR=1e-4):
    """The reference with one rounding rule changed."""
    if rule == "weight_after_rounding":
        return quantize_reference(_product(h, weight, weighted=False).float() * weight[:, None], BLOCK, FLOOR)
    a = _product(h, weight, rounded=False)
    if rule == "no_rounding_point":
        return quantize_reference(a, BLOCK, FLOOR)
    if rule == "bf16_truncated":
        return quantize_reference((a.view(torch.int32) & -65536).view(torch.float32), BLOCK, FLOOR)
    return naive_quantise(a.to(h.dtype), BLOCK, FLOOR, values="toward_zero")


@pytest.mark.parametrize("rule", ["no_rounding_point", "weight_after_rounding", "bf16_truncated",
                                  "values_toward_zero"])
def test_a_wrong_rounding_is_caught(rule):
    """Quantising the f32 product (no bf16 rounding point), weighting after that rounding,
    truncating to bf16, or rounding the e4m3 values toward zero each gives other bytes."""
    case = {"T": 8, "I": 512, "weighted": True}
    inputs = kernel_bytes(case, seed=4)
    args = {"h": inputs["h"], "weight": inputs["weight"]}
    assert matches(inputs, SPEC.reference(**args))
    assert matches(inputs, naive_quantise(_product(**args), 128))  # model.md's quantiser written out
    assert not matches(inputs, _wrong(**args, rule=rule))


def test_a_scale_off_by_one_code_fails_the_registered_check_too():
    """test_interpret's tolerance allows a GPU's one e4m3 step in q, never a different code."""
    case = {"T": 4, "I": 256}
    inputs = kernel_bytes(case, seed=2)
    ref = SPEC.run_reference(inputs, case)
    check_outputs(SPEC, case, inputs, ref)
    with pytest.raises(AssertionError, match="swiglu_quant/scale"):
        check_outputs(SPEC, case, inputs, {"q": ref["q"], "scale": ref["scale"] - 1})


def test_invalid_calls_give_clear_errors():
    h = torch.randn(3, 512).to(torch.bfloat16)
    q, scale = torch.empty(3, 256, dtype=torch.float8_e4m3fn), torch.empty(3, 2, dtype=torch.uint8)
    kernel = codegen.compile(SPEC.kernel, "interpret")
    with pytest.raises(CallError, match=r"argument 'h' has 3 dimensions \(3, 2, 256\), expected 2 \(T, I2\)"):
        kernel(h=h.view(3, 2, 256), q=q, scale=scale)  # the halves as a view: the rows are passed as they are
    with pytest.raises(DslError, match=r"swiglu_quant.py:\d+ .*h must be \[T, 2I\].*'I2': 512, 'I': 128"):
        kernel(h=h, q=q[:, :128], scale=scale)  # q half of h's half
    with pytest.raises(CallError, match=r"argument 'weight' has dtype bf16, expected f32"):
        kernel(h=h, q=q, scale=scale, weight=torch.ones(3, dtype=torch.bfloat16))
    with pytest.raises(CallError, match=r"argument 'weight' has T=6, but argument 'h' bound T=3"):
        kernel(h=h, q=q, scale=scale, weight=torch.ones(6))
    with pytest.raises(DslError, match=r"LIMIT -1.0 must be a positive finite number"):
        SPEC.kernel.trace(constants={"LIMIT": -1.0})
    with pytest.raises(DslError, match=r"BLOCK 0 must be a positive int"):
        SPEC.kernel.trace(constants={"BLOCK": 0})


def test_a_build_serves_every_row_count_of_its_bucket_and_tunables_change_no_bit():
    g = torch.Generator().manual_seed(9)
    h = (torch.randn(13, 2, 200, generator=g) * 4).to(torch.bfloat16).flatten(1)
    weight = torch.rand(13, generator=g)
    full_q, full_s = run(h, weight, 32)
    kernel = codegen.compile(SPEC.kernel, "interpret", config={"ROWS": 4, "BLOCKS": 2}, constants={"BLOCK": 32})
    for t in (1, 6, 7, 13):  # buckets 1, 8, 8, 16
        q, s = torch.empty(t, 200, dtype=torch.float8_e4m3fn), torch.empty(t, 7, dtype=torch.uint8)
        kernel(h=h[:t].contiguous(), q=q, scale=s, weight=weight[:t].contiguous())
        assert same_bits(q, full_q[:t]) and torch.equal(s, full_s[:t]), t
    assert len(kernel._cache) == 3
    for config in ({"ROWS": 1, "BLOCKS": 1}, {"ROWS": 16, "BLOCKS": 16}, {"ROWS": 2, "BLOCKS": 4}):
        q, s = run(h, weight, 32, config=config)
        assert same_bits(q, full_q) and torch.equal(s, full_s), config


def test_model_shapes_are_the_experts_and_the_shared_expert_of_both_models():
    got = {m: {(c["I"], c["BLOCK"], c["NB"], bool(c.get("weighted"))) for c in SPEC.model_cases(m).values()}
           for m in ("v4", "v41")}
    assert got == {"v4": {(2048, 128, 16, True), (2048, 128, 16, False)},
                   "v41": {(2304, 32, 72, True), (2304, 32, 72, False)}}
    rows = {(c["T"], bool(c.get("weighted"))) for c in SPEC.model_shapes.values()}
    assert rows == {(t, False) for t in (1, 16, 64, 4096)} | {(6 * t, True) for t in (1, 16, 64, 4096)}
