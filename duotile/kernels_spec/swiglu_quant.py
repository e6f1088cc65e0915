"""The experts' clamped SwiGLU fused with the FP8 activation quantiser in front of ``w2`` (model.md
2.6, 2.7, 2.10, 4.1, 5.2; V4.1's 32-wide blocks in 1.7, 2.13, 4.3).

``h`` is the up-projection's output as one tensor: the fused ``w1`` / ``w3`` GEMM (gate rows, then
up rows: ``shared_w13`` and the experts' grouped GEMM 1) gives [T, 2I] rows ``[gate | up]``
(``h[:, :I]`` = gate = ``x @ w1^T``, ``h[:, I:]`` = up = ``x @ w3^T``), passed as it is; a call
whose ``h`` is not twice ``q``'s width is refused. Rows are the shared expert's tokens, or the routed pairs
in their grouped order (``moe_permute``) with each pair's routing weight. Per row, in f32::

    g     = min(gate, LIMIT)                 u = clamp(up, -LIMIT, LIMIT)        LIMIT = 10
    a     = rnd(g / (1 + exp(-g)) * u [* weight])                            rnd = round to h's dtype
    per block of BLOCK channels (128 in V4, 32 in V4.1): q, code = quantize(a)  (quantize.py)

as the runtime's ``Expert`` computes it (runtime/layers/moe.py, model.md 2.6): silu of the clamped
gate times the clamped up, times the row's routing weight where ``weight`` (T, f32) is given (a
routed expert's; the shared expert has none), then rounded to the activation dtype (the BF16
tensor ``w2``'s quantiser reads; none with f32 activations) and quantised per 1 x BLOCK: amax =
max(max |a|, FLOOR), the smallest power-of-two scale with amax / s <= 448 from amax's bits (model.md
2.10: amax = 448 x 2^k gives 2^k), ``q = e4m3(a / s)``; outputs ``q`` (T x I, e4m3) and ``scale``
(T x ceil(I / BLOCK), uint8 UE8M0 codes). silu is ``g / (1 + exp(-g))``, the formula of torch's
``silu``, with the interpreter's exp; the clamps are comparisons, so a NaN stays NaN on every
target (a min / max of a NaN would differ): +-Inf in up and +Inf in gate clamp to the limit, a NaN
stays NaN and a gate of -Inf gives silu NaN (-Inf / Inf), as torch's. A block holding a NaN (or an
Inf: a routing weight's) gets code 255 and ``q = a * 0``, as ``quantize.py``.

Each program takes ``ROWS`` rows and ``BLOCKS`` of their blocks (a tile per half and block); the
tunables change no bit of the result.

Exactness: on the interpreter the outputs are the reference's bit for bit (the tests check
bytes). Elsewhere a target's exp and division differ in the last bits, which can move a rounding
of ``a`` and so a value by one e4m3 step (the tolerance); scale codes are exact unless a block's
amax lies within that distance of 448 x 2^k. CUDA builds flush subnormals (quantised to zero
anyway below the scale floor).

Decode path: each row is computed on its own: batch dimension T, dynamic and bucketed (each
power-of-two bucket of T gets its own config and build, as ``quantize.py``: a prefill chunk's
rows want more rows a program than a decode step's few; only max reductions, so no bit depends on
the config, which check_batch_invariance enforces).
"""

from __future__ import annotations

import math

import torch

from .. import dsl
from . import model_shapes as shapes
from .quantize import quantize_reference
from .registry import Dim, OneOf, Spec, register
from .rmsnorm_quant import E4M3_STEP, check_quant_constants, quantize_block

SWIGLU_LIMIT = 10.0  # swiglu_limit (model.md 1.1; V4.1 the same)


@dsl.kernel(batch_dim="T", bucketed=("T",))
def swiglu_quant(h: dsl.Tensor["T", "I2", dsl.bf16 | dsl.f32], q: dsl.Tensor["T", "I", dsl.f8e4m3],
                 scale: dsl.Tensor["T", "NB", dsl.u8], weight: dsl.OptionalTensor["T", dsl.f32] = None, *,
                 BLOCK: dsl.Const = 128, LIMIT: dsl.Const = SWIGLU_LIMIT, FLOOR: dsl.Const = 1e-4,
                 ROWS: dsl.Tunable = dsl.choice(1, 2, 4, 8, 16), BLOCKS: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16)):
    floor = check_quant_constants(BLOCK, FLOOR)
    if not (isinstance(LIMIT, (int, float)) and not isinstance(LIMIT, bool) and 0 < LIMIT < math.inf):
        raise dsl.DslError(f"LIMIT {LIMIT!r} must be a positive finite number: the SwiGLU clamp")
    limit = float(LIMIT)
    for cond in (h.I2 >= 2 * q.I, h.I2 <= 2 * q.I):
        dsl.require(cond, "h must be [T, 2I]: the gate's I columns, then the up's I (q is I wide)")
    for t, n in dsl.grid(dsl.cdiv(h.T, ROWS), dsl.cdiv(q.I, BLOCK * BLOCKS)):
        row = t * ROWS
        for j in dsl.range(BLOCKS):
            blk = n * BLOCKS + j
            cols = blk * BLOCK + dsl.arange(BLOCK)
            # a last block cut short by I would read the up half's first columns as gate: zeros there
            gate = dsl.where(cols[None, :] < q.I, dsl.load(h[row, blk * BLOCK], (ROWS, BLOCK)).to(dsl.f32), 0.0)
            up = dsl.load(h[row, q.I + blk * BLOCK], (ROWS, BLOCK)).to(dsl.f32)
            g = dsl.where(gate > limit, limit, gate)
            u = dsl.where(up > limit, limit, dsl.where(up < -limit, -limit, up))
            a = g / (1.0 + dsl.exp(-g)) * u
            if weight is not None:
                a = a * dsl.load(weight[row], (ROWS,))[:, None]
            quantize_block(q, scale, row, blk * BLOCK, blk, a.to(h.dtype).to(dsl.f32), floor)


def swiglu_quant_reference(h: torch.Tensor, weight: torch.Tensor | None = None, BLOCK: int = 128,
                           LIMIT: float = SWIGLU_LIMIT, FLOOR: float = 1e-4) -> dict:
    """model.md 2.6's clamped SwiGLU (times the routing weight), rounded to the activation dtype,
    then the FP8 activation quantiser's reference (model.md 2.7, 2.10, 4.1: ``quantize_reference``)."""
    i = h.shape[1] // 2
    g = h[:, :i].float().clamp(max=LIMIT)
    u = h[:, i:].float().clamp(-LIMIT, LIMIT)
    a = g / (1 + torch.exp(-g)) * u
    if weight is not None:
        a = a * weight.float()[:, None]
    return quantize_reference(a.to(h.dtype), BLOCK, FLOOR)


def _block(case) -> int:
    return case.get("BLOCK", 128)


def _halves(kind: str, t: int, i: int, gen: torch.Generator) -> torch.Tensor:
    """h (T x 2 x I) of one kind:

    * ``normal``: gate and up of magnitude about 3 (the clamps bind in the tails);
    * ``zeros``: every other row's gate zero (silu 0), the others' up -0 in their first half;
    * ``clamp``: magnitudes up to 1e4 with +-Inf in up and +Inf in gate: the clamps decide;
      very negative gates (silu -0) among them;
    * ``floor``: magnitudes 2^-12 .. 2^-2 a half: products under, at and just past the scale floor;
    * ``wide``: magnitudes 2^-12 .. 2^8 a half: per-row scales far apart.
    """
    x = torch.randn(t, 2, i, generator=gen)
    if kind == "normal":
        return 3 * x
    if kind == "zeros":
        x[::2, 0] = 0.0
        x[1::2, 1, : i // 2] = -0.0
        return x
    if kind == "clamp":
        x = x * 1e4
        spots = torch.rand(t, 2, i, generator=gen)
        x[:, 1][spots[:, 1] < 0.05] = float("inf")
        x[:, 1][spots[:, 1] > 0.95] = float("-inf")
        x[:, 0][spots[:, 0] < 0.05] = float("inf")
        return x
    if kind == "floor":
        return x * torch.exp2(torch.randint(-12, -1, (t, 2, 1), generator=gen).float())
    if kind == "wide":
        return x * torch.exp2(torch.randint(-12, 9, (t, 2, 1), generator=gen).float())
    raise ValueError(f"unknown value kind {kind!r}")


def _routing_weights(t: int, gen: torch.Generator) -> torch.Tensor:
    """Router-like weights (renormalised top-6 shares times 1.5: about 0.1 .. 1), a zero among them."""
    w = torch.rand(t, generator=gen) * 0.9 + 0.1
    w[::7] = 0.0
    return w


def _inputs(case, device, seed):
    t, i = case["T"], case["I"]
    nb = case.get("NB", -(-i // _block(case)))
    dtype = torch.float32 if case.get("dtype") == "f32" else torch.bfloat16
    out = {"q": torch.empty(t, i, dtype=torch.float8_e4m3fn, device=device),
           "scale": torch.empty(t, nb, dtype=torch.uint8, device=device)}
    if device.type == "meta":
        out["h"] = torch.empty(t, 2 * i, dtype=dtype, device=device)
        if case.get("weighted"):
            out["weight"] = torch.empty(t, dtype=torch.float32, device=device)
        return out
    gen = torch.Generator().manual_seed(seed)
    out["h"] = _halves(case.get("values", "normal"), t, i, gen).flatten(1).to(dtype).to(device)
    if case.get("weighted"):
        out["weight"] = _routing_weights(t, gen).to(device)
    return out


def _tolerance(case, out):
    """The interpreter is exact (the module docstring); a GPU's exp and division may move a value
    by one e4m3 step (at most 1/8 of it, or 2^-9 among subnormals); codes are exact."""
    return (E4M3_STEP, 0.125) if out == "q" else (0.0, 0.0)


def swiglu_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict[str, shapes.Case]:
    """The routed experts' SwiGLU over every (token, expert) pair of a step (``experts_per_token``
    pairs a token, grouped, weighted) and the shared expert's over the tokens (unweighted), for the
    decode token counts ``decode_t`` and a prefill chunk; I = the expert width (2048 in V4, 2304 in
    V4.1, the shared expert's too), one code per ``fp8_block`` channels."""
    out: dict[str, shapes.Case] = {}
    i = m.moe_intermediate
    for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]:
        for what, rows, weighted in (("experts", m.experts_per_token * t, True), ("shared", t, False)):
            case = {"T": rows, "I": i, "NB": i // m.fp8_block, "BLOCK": m.fp8_block, "model": m.name}
            if weighted:
                case["weighted"] = True
            out[f"{m.short}/{what}_i{i}/{phase}"] = case
    return out


CASES = {
    "v4_t3_i2048_weighted": {"T": 3, "I": 2048, "weighted": True},
    "v41_t2_i2304_b32": {"T": 2, "I": 2304, "BLOCK": 32, "config": {"BLOCKS": 16}},
    "ragged_t5_i200_b32": {"T": 5, "I": 200, "BLOCK": 32, "weighted": True},  # a last block of 8
    # 4 rows a program over 7 (the last program's fourth row past T); a last gate block of 8 columns
    # beside the up half's first, which must not count
    "rows4_t7_i200_weighted": {"T": 7, "I": 200, "BLOCK": 32, "values": "wide", "weighted": True,
                               "config": {"ROWS": 4, "BLOCKS": 2}},
    "ragged_t4_i300": {"T": 4, "I": 300, "config": {"BLOCKS": 1}},  # 44 channels
    "zeros_t6_i256_weighted": {"T": 6, "I": 256, "values": "zeros", "weighted": True},
    "clamp_t5_i256": {"T": 5, "I": 256, "values": "clamp"},
    "clamp_f32_t4_i96_b32": {"T": 4, "I": 96, "BLOCK": 32, "dtype": "f32", "values": "clamp", "weighted": True},
    "floor_t4_i256_b32": {"T": 4, "I": 256, "BLOCK": 32, "values": "floor", "weighted": True},
    "floor_f32_t3_i128": {"T": 3, "I": 128, "dtype": "f32", "values": "floor"},
    "wide_t6_i160_b32": {"T": 6, "I": 160, "BLOCK": 32, "values": "wide", "config": {"ROWS": 16, "BLOCKS": 2}},
    "f32_t7_i96": {"T": 7, "I": 96, "dtype": "f32", "weighted": True},
}

SPEC = register(Spec(
    kernel=swiglu_quant,
    reference=swiglu_quant_reference,
    make_inputs=_inputs,
    outputs=("q", "scale"),
    cases=CASES,
    build_cases={"v4_experts": {"T": 6 * 4096, "I": 2048, "weighted": True},
                 "v41_shared": {"T": 4096, "I": 2304, "BLOCK": 32}},
    tolerance=_tolerance,
    constants_of=lambda case: {"BLOCK": _block(case)},
    flops=lambda c: 10.0 * c["T"] * c["I"],
    bytes_moved=lambda c: c["T"] * c["I"] * (2 * (2 if c.get("dtype") != "f32" else 4) + 1)
    + c["T"] * (-(-c["I"] // _block(c)) + (4 if c.get("weighted") else 0)),
    model_shapes=shapes.for_models(swiglu_shapes),
    sweep={"T": Dim(1, 24, large=4099), "I": Dim(1, 400, large=4608), "BLOCK": OneOf(32, 128),
           "dtype": OneOf("bf16", "f32"), "weighted": OneOf(True, False),
           "values": OneOf("normal", "zeros", "clamp", "floor", "wide"),
           "config": {"ROWS": OneOf(1, 2, 4, 8, 16), "BLOCKS": OneOf(1, 2, 4, 8, 16)}},
))
