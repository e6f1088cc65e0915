"""The MoE router's selection (model.md 2.6): from the gate logits to each token's experts and
their weights. The logits ``x @ w_gate^T`` (T x E, f32) are a GEMM the ``gemm`` spec serves;
this kernel takes them and the per-expert bias (E, f32):

    s       = sqrt(softplus(logits))                                  (f32)
    experts = the TOPK experts of largest s + bias, in that order     (ties: the lowest index first)
    weights = s[experts] / sum(s[experts]) * SCALE                    (the bias only picks)

TOPK = 6 and SCALE = 1.5 in both models; E = 256 (V4-Flash) or 384 (V4.1-Flash). The
output's ``K`` must equal ``TOPK`` (a build cannot check it: ``K`` is a size, ``TOPK`` a
constant the rounds unroll over; ``constants_of`` takes TOPK from the case's K).

The selection runs TOPK rounds over one row tile holding every expert (a power of two wide;
the padding reads logits -inf, so s = 0 there, and bias -inf, so it is never picked): the
largest live biased score ``m``, then the lowest expert index whose live score equals ``m`` (a
``min`` over ``where(score == m, index, E)``), then that expert leaves (its score becomes -inf).
A real expert's biased score is finite for finite inputs, so a taken one never ties with ``m``;
this needs E >= TOPK, as in every model (256 / 384 >= 6; 128 >= 3 in V4.1's DSpark blocks).
Indices are carried as f32 (exact below 2^24) so that every reduction is a float max / min,
which every target lowers. The weight of a round is the chosen expert's unbiased ``s`` (a max
over one hit: exact); the sum runs in pick order, ``((w0 + w1) + w2) + ...``, the same on every
target, and each weight is ``w_k / total * SCALE``.

softplus, as written here and in the reference (both the same f32 operations, so the
interpreter is bit-exact against the reference)::

    softplus(x) = max(x, 0) + log1p(exp(-|x|))
    log1p(y)    = log(u) + (y - (u - 1)) / u,   u = 1 + y        (y in [0, 1])

The DSL has no log1p; ``u - 1`` is exact (Sterbenz) and ``y - (u - 1)`` is exactly the rounding
error of ``1 + y`` (Fast2Sum, |y| <= 1), so the correction restores log1p's accuracy for small y
(plain ``log(1 + y)`` loses all of it below 2^-24: softplus(-30) would be 0). torch's
``F.softplus`` (the runtime's) computes ``log1p(exp(x))`` below its threshold 20 and ``x`` above;
the two agree to a few ulp (tests/kernels_spec/test_router.py), not bit for bit.

Tolerances: experts exact everywhere (0, 0); weights exact on the interpreter (the test checks
bit equality) and within 1e-6 + 1e-5 relative elsewhere, since a GPU's expf / logf are not
torch's CPU ones (a few ulp), and the CUDA builds flush subnormals (``--ftz``). A row holding a
NaN logit or bias, or an infinite bias, has unspecified experts.

Decode path: each row is routed on its own; T is dynamic and the batch dimension.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register

NEG_INF = float("-inf")


@dsl.kernel(batch_dim="T", dynamic=("T",))
def router(logits: dsl.Tensor["T", "E", dsl.f32], bias: dsl.Tensor["E", dsl.f32],
           experts: dsl.Tensor["T", "K", dsl.i32], weights: dsl.Tensor["T", "K", dsl.f32], *,
           TOPK: dsl.Const = 6, SCALE: dsl.Const = 1.5,
           ROWS: dsl.Tunable = dsl.choice(1, 2, 4, 8)):
    if not (isinstance(TOPK, int) and TOPK >= 1):
        raise dsl.DslError(f"TOPK {TOPK!r} must be a positive int: the rounds unroll over it")
    n = logits.E
    # every expert in one row tile, a power of two wide: TileLang's row reductions on CUDA need a
    # power-of-two count of threads a row (a 384-wide tile fails at 512 threads); Ascend, which
    # lowers whole tiles only, then refuses 384 experts (a partial 512-wide tile)
    width = dsl.next_pow2(n)
    for t in dsl.grid(dsl.cdiv(logits.T, ROWS)):
        # padding reads logits -inf (s = 0) and bias -inf (biased score -inf): never picked
        x = dsl.load(logits[t * ROWS, 0], (ROWS, width), other=NEG_INF)
        y = dsl.exp(-abs(x))
        u = 1.0 + y
        s = dsl.sqrt(dsl.maximum(x, 0.0) + (dsl.log(u) + (y - (u - 1.0)) / u))
        ids = dsl.arange(width).to(dsl.f32)[None, :]
        live = dsl.empty((ROWS, width), dsl.f32)  # the biased scores; a taken expert's is -inf
        live[:] = s + dsl.load(bias[0], (width,), other=NEG_INF)[None, :]
        picked, w = [], []
        for _ in range(TOPK):  # unrolled at trace time
            top = live.max(axis=1)
            idx = dsl.where(live.eq(top[:, None]), ids, n).min(axis=1)  # ties: the lowest index
            # the test is written at each use: a bool tile used twice would be materialised, which
            # TileLang's Ascend lowering cannot vectorise (int8x2); used once it fuses away
            w.append(dsl.where(ids.eq(idx[:, None]), s, 0.0).max(axis=1))  # its unbiased score, exactly
            live[:] = dsl.where(ids.eq(idx[:, None]), NEG_INF, live)
            picked.append(idx)
        total = w[0]
        for wk in w[1:]:  # in pick order
            total = total + wk
        for k in range(TOPK):
            dsl.store(experts[t * ROWS, k], picked[k][:, None].to(dsl.i32))
            dsl.store(weights[t * ROWS, k], (w[k] / total * SCALE)[:, None])


def softplus(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0) + log1p(exp(-|x|)), log1p by its compensated form (the module docstring)."""
    y = torch.exp(-x.abs())
    u = 1.0 + y
    return torch.maximum(x, torch.zeros_like(x)) + (torch.log(u) + (y - (u - 1.0)) / u)


def router_reference(logits: torch.Tensor, bias: torch.Tensor, TOPK: int = 6, SCALE: float = 1.5) -> dict:
    """model.md 2.6: top-TOPK of sqrt(softplus(logits)) + bias by a stable descending sort (ties
    keep the lower index first); weights the unbiased scores of those, over their sum (in pick
    order), times SCALE."""
    s = torch.sqrt(softplus(logits.float()))
    idx = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices[:, :TOPK]
    w = s.gather(-1, idx)
    total = w[:, 0]
    for k in range(1, TOPK):
        total = total + w[:, k]
    return {"experts": idx.to(torch.int32), "weights": w / total[:, None] * SCALE}


def _logits(kind: str, t: int, e: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, bias) of one kind: ``normal`` (N(0, 1) logits, a small bias), ``ties`` (logits
    from five values, no bias: every pick is a tie the lowest index wins), ``bias_flip`` (a bias
    far larger than the logits' spread: it, not the scores, picks), ``equal`` (one value a row:
    experts 0..TOPK-1, equal weights), ``huge`` / ``tiny`` (magnitudes 1e30 / 1e-30), ``mixed``
    (magnitudes 2^-60 .. 2^60 in one row, either sign: softplus's tails)."""
    x = torch.randn(t, e, generator=g)
    bias = 0.1 * torch.randn(e, generator=g)
    if kind == "normal":
        return x, bias
    if kind == "ties":
        return torch.randint(-2, 3, (t, e), generator=g).float() * 0.75, torch.zeros(e)
    if kind == "bias_flip":
        return 0.1 * x, 3.0 * torch.randn(e, generator=g)
    if kind == "equal":
        return torch.randn(t, 1, generator=g).expand(t, e).contiguous(), torch.zeros(e)
    if kind == "huge":
        return x * 1e30, bias
    if kind == "tiny":
        return x * 1e-30, torch.zeros(e)
    if kind == "mixed":
        return x * torch.exp2(torch.randint(-60, 61, (t, e), generator=g).float()), bias
    raise ValueError(f"unknown logits kind {kind!r}")


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    t, e, k = case["T"], case["E"], case.get("K", 6)
    logits, bias = _logits(case.get("values", "normal"), t, e, g)
    return {"logits": logits.to(device), "bias": bias.to(device),
            "experts": torch.full((t, k), -1, dtype=torch.int32, device=device),
            "weights": torch.full((t, k), float("nan"), dtype=torch.float32, device=device)}


def _tolerance(case, out):
    return (0.0, 0.0) if out == "experts" else (1e-6, 1e-5)


SPEC = register(Spec(
    kernel=router,
    reference=router_reference,
    make_inputs=_inputs,
    outputs=("experts", "weights"),
    cases={"t5_e256": {"T": 5, "E": 256}, "t1_e384": {"T": 1, "E": 384},
           "ragged_t13_e384": {"T": 13, "E": 384, "config": {"ROWS": 4}},
           "ties_t9_e256": {"T": 9, "E": 256, "values": "ties", "config": {"ROWS": 2}},
           "bias_flip_t7_e384": {"T": 7, "E": 384, "values": "bias_flip"},
           "equal_t6_e256": {"T": 6, "E": 256, "values": "equal", "config": {"ROWS": 8}},
           "huge_t4_e256": {"T": 4, "E": 256, "values": "huge"},
           "tiny_t4_e384": {"T": 4, "E": 384, "values": "tiny"},
           "mixed_t11_e384": {"T": 11, "E": 384, "values": "mixed", "config": {"ROWS": 2}},
           "dspark_top3_e128": {"T": 3, "E": 128, "K": 3}},  # V4.1's DSpark blocks: 128 experts, top 3
    build_cases={"v4_prefill": {"T": 4096, "E": 256}, "v41_decode": {"T": 64, "E": 384}},
    tolerance=_tolerance,
    constants_of=lambda case: {"TOPK": case.get("K", 6)},
    flops=lambda c: 12.0 * c["T"] * c["E"] * (1 + c.get("K", 6)),
    bytes_moved=lambda c: 4.0 * (c["T"] * c["E"] + c["E"] + 2 * c["T"] * c.get("K", 6)),
    model_shapes=shapes.for_models(shapes.router_shapes),
    sweep={"T": Dim(1, 67, large=4099), "E": OneOf(8, 64, 128, 256, 384, 300),
           "values": OneOf("normal", "ties", "bias_flip", "equal", "huge", "tiny", "mixed"),
           "config": {"ROWS": OneOf(1, 2, 4, 8)}},
))
