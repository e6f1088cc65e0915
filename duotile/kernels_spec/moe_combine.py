"""MoE combine (model.md 2.6.2, 5.2 "combine"): each token's routed experts' rows summed back into
its output row, plus the shared expert's row.

    out[t] = bf16( sum_k expert_out[where[t, k]]  +  shared_out[t] )        (f32 sums)

``expert_out`` (P x D bf16) holds the down projections' rows in the grouped order of
``moe_permute`` (P = T * K pairs, D = hidden: 4096 in V4-Flash, 5120 in V4.1-Flash), ``where``
(T x K) is that permutation's inverse map, ``shared_out`` (T x D bf16) the shared expert's rows.
Each token gathers its K rows (a gather by an index tile) instead of the experts scattering into
it with atomic adds, so a token's output depends on its own rows only: the same bits at every
batch size and on every run. A ``where`` outside [0, P) (a pair left out) adds a zero row.

Where the routing weight goes: model.md 2.6.2 / 2.14 point 10 multiply it (with the 1.5 scale,
already in the router's weights) into the SwiGLU activation *before* ``w2``, as the runtime's
``Expert`` does (runtime/layers/moe.py), so the rows arrive weighted and the model's combine is the
plain sum above. For an engine that leaves the weight to the combine, the optional ``weights``
(T x K f32) multiplies each row first: ``sum_k weights[t, k] * expert_out[where[t, k]]``.

The sum's order is the runtime's batch-invariant one (``InvariantOps.sum`` over the K slots, then
``+ shared``): a pairwise tree over the slots padded to a power of two, for K = 6
``((y0 + y4) + y2) + ((y1 + y5) + y3)`` (a padding zero is left out: ``y + 0`` only changes a
-0.0 to +0.0, which the final ``+ shared`` and bf16 compare as equal). Unweighted, every step is
an f32 add of exact bf16 values, the same IEEE operations on every target: bit-exact, as the test
checks against the runtime's MoE with ``InvariantOps``. Weighted, a GPU may contract
``w * y + acc`` into one fused multiply-add (one rounding instead of two); the tolerance covers it
(``_tolerance``). CUDA builds flush subnormals (``ftz``): bf16 inputs below 2^-126 read as zero
there (the cases draw none).

Decode path: each token's row is combined on its own; T is dynamic and the batch dimension, P
(the grouped rows) dynamic too.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .moe_permute import moe_permute_reference
from .registry import Dim, OneOf, Spec, register


def tree_order(n: int) -> list:
    """The pairwise order ``InvariantOps.sum`` adds ``n`` terms in, as nested pairs of term
    indices (None: a padding zero): pad to a power of two, then add the first half to the second
    until one term is left."""
    terms: list = list(range(n)) + [None] * ((1 << max(0, n - 1).bit_length()) - n)
    while len(terms) > 1:
        half = len(terms) // 2
        terms = [(a, b) for a, b in zip(terms[:half], terms[half:])]
    return terms[0]


def add_in_order(node, term):
    """Add the terms ``term(i)`` in the order ``tree_order`` gives, skipping padding zeros."""
    if node is None or isinstance(node, int):
        return None if node is None else term(node)
    a, b = (add_in_order(x, term) for x in node)
    return b if a is None else a if b is None else a + b


@dsl.kernel(batch_dim="T", dynamic=("T", "P"))
def moe_combine(expert_out: dsl.Tensor["P", "D", dsl.bf16], where: dsl.Tensor["T", "K", dsl.i32],
                shared_out: dsl.Tensor["T", "D", dsl.bf16], out: dsl.Tensor["T", "D", dsl.bf16],
                weights: dsl.OptionalTensor["T", "K", dsl.f32] = None, *,
                TOPK: dsl.Const = 6,
                BT: dsl.Tunable = dsl.choice(4, 1, 2, 8, 16),
                BD: dsl.Tunable = dsl.choice(512, 256, 1024, 128)):
    if not (isinstance(TOPK, int) and TOPK >= 1):
        raise dsl.DslError(f"TOPK {TOPK!r} must be a positive int: the slots unroll over it")
    for t, d in dsl.grid(dsl.cdiv(out.T, BT), dsl.cdiv(out.D, BD)):
        def row(k, t=t, d=d):
            """Slot k's rows of the tile in f32, times their weights if the call gives them."""
            idx = dsl.load(where[t * BT, k], (BT, 1), other=-1)
            y = dsl.load(expert_out[idx, d * BD], (BT, BD)).to(dsl.f32)
            if weights is not None:
                y = y * dsl.load(weights[t * BT, k], (BT, 1))
            return y

        total = add_in_order(tree_order(TOPK), row)
        total = total + dsl.load(shared_out[t * BT, d * BD], (BT, BD)).to(dsl.f32)
        dsl.store(out[t * BT, d * BD], total.to(dsl.bf16))


def moe_combine_reference(expert_out: torch.Tensor, where: torch.Tensor, shared_out: torch.Tensor,
                          weights: torch.Tensor | None = None, TOPK: int = 6) -> dict:
    """model.md 2.6.2: the K rows of each token (a zero row for a pair left out), times their
    weights if given, summed in the tree order of ``InvariantOps.sum`` in f32, plus the shared
    row, rounded to bf16 once."""
    valid = (where >= 0) & (where < expert_out.shape[0])
    safe = torch.where(valid, where, torch.zeros_like(where)).long()
    rows = expert_out.float()[safe]  # (T, K, D)
    rows = torch.where(valid[..., None], rows, torch.zeros_like(rows))
    if weights is not None:
        rows = rows * weights.float()[..., None]
    total = add_in_order(tree_order(TOPK), lambda k: rows[:, k])
    return {"out": (total + shared_out.float()).to(torch.bfloat16)}


def _routing(case, g: torch.Generator) -> torch.Tensor:
    """``where`` from a permutation of router-like (or skewed / repeated / left-out) expert ids."""
    t, k, e = case["T"], case.get("K", 6), case.get("E", 64)
    kind = case.get("ids", "router")
    if kind == "router":
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    elif kind == "skewed":
        ids = torch.randint(0, 3, (t, k), generator=g)
    elif kind == "repeat":
        ids = torch.randint(0, e, (t, k), generator=g)
        ids[:, k // 2] = ids[:, 0]
    elif kind == "outside":
        ids = torch.randint(0, e, (t, k), generator=g)
        ids[torch.rand(t, k, generator=g) < 0.2] = -1
    else:
        raise ValueError(f"unknown ids kind {kind!r}")
    return moe_permute_reference(ids.to(torch.int32), e)["where"]


def _inputs(case, device, seed):
    t, k, d = case["T"], case.get("K", 6), case["D"]
    p = case.get("P", t * k)
    weighted = case.get("weighted", False)
    if device.type == "meta":
        where = torch.empty(t, k, dtype=torch.int32)
        rows, shared, w = torch.empty(p, d), torch.empty(t, d), torch.empty(t, k)
    else:
        g = torch.Generator().manual_seed(seed)
        where = _routing(case, g)
        rows, shared = torch.randn(p, d, generator=g), torch.randn(t, d, generator=g)
        w = torch.rand(t, k, generator=g) * 0.5
        if case.get("values") == "cancel":  # rows that cancel: the sum is small beside its terms
            shared = -rows[where.clamp(min=0).long()].sum(1) + 1e-2 * shared
    out = {"expert_out": rows.to(torch.bfloat16).to(device), "where": where.to(device),
           "shared_out": shared.to(torch.bfloat16).to(device),
           "out": torch.full((t, d), float("nan"), dtype=torch.bfloat16, device=device)}
    if weighted:
        out["weights"] = w.to(device)
    return out


def _tolerance(case, out):
    """Unweighted: exact (adds of bf16 values in one order). Weighted: a GPU's fused multiply-adds
    change each f32 partial by at most an f32 rounding of its terms (``_extra_error``), which can
    move the bf16 result by one bf16 unit (2^-7 relative)."""
    return (0.0, 2.0 ** -7) if case.get("weighted") else (0.0, 0.0)


def _extra_error(case, out, inputs):
    """Weighted: K + 1 f32 roundings, each at most 2^-24 of the sum of the terms' magnitudes."""
    if not case.get("weighted"):
        return torch.zeros(())
    where, rows = inputs["where"], inputs["expert_out"].float()
    valid = ((where >= 0) & (where < rows.shape[0]))[..., None]
    terms = torch.where(valid, rows[where.clamp(0, rows.shape[0] - 1).long()], torch.zeros(()))
    mag = (terms.abs() * inputs["weights"].float().abs()[..., None]).sum(1) + inputs["shared_out"].float().abs()
    return (case.get("K", 6) + 1) * 2.0 ** -24 * mag * 2


def combine_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict:
    """Each model's hidden rows at the decode rows ``decode_t`` and a prefill chunk, K = top-k
    rows a token."""
    out = {}
    for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]:
        k = m.experts_per_token
        out[f"{m.short}/h{m.hidden}_top{k}/{phase}"] = {"T": t, "K": k, "P": k * t, "D": m.hidden, "model": m.name}
    return out


SPEC = register(Spec(
    kernel=moe_combine,
    reference=moe_combine_reference,
    make_inputs=_inputs,
    outputs=("out",),
    cases={"t5_d512": {"T": 5, "D": 512}, "t1_d640": {"T": 1, "D": 640, "config": {"BT": 1, "BD": 128}},
           "ragged_t13_d700": {"T": 13, "D": 700, "config": {"BT": 8, "BD": 256}},
           "weighted_t7_d384": {"T": 7, "D": 384, "weighted": True, "config": {"BT": 2, "BD": 128}},
           "skewed_t9_d256": {"T": 9, "D": 256, "ids": "skewed"},
           "repeat_t6_d256": {"T": 6, "D": 256, "ids": "repeat", "weighted": True},
           "outside_t11_d256": {"T": 11, "D": 256, "ids": "outside", "config": {"BT": 16, "BD": 128}},
           "cancel_t8_d512": {"T": 8, "D": 512, "values": "cancel", "weighted": True},
           "dspark_top3": {"T": 5, "K": 3, "D": 256}},
    build_cases={"v4_decode": {"T": 64, "K": 6, "D": 4096}, "v41_prefill": {"T": 4096, "K": 6, "D": 5120}},
    tolerance=_tolerance,
    extra_error=_extra_error,
    constants_of=lambda case: {"TOPK": case.get("K", 6)},
    flops=lambda c: float(c["T"] * c["D"] * (c.get("K", 6) + 1)),
    bytes_moved=lambda c: 2.0 * c["D"] * c["T"] * (c.get("K", 6) + 2) + 4.0 * c["T"] * c.get("K", 6),
    model_shapes=shapes.for_models(combine_shapes),
    sweep={"T": Dim(1, 40, large=4099), "D": Dim(8, 600, multiple=8, large=5120), "K": OneOf(6, 6, 3),
           "weighted": OneOf(False, True), "ids": OneOf("router", "skewed", "repeat", "outside"),
           "config": {"BT": OneOf(1, 2, 4, 8, 16), "BD": OneOf(128, 256, 512)}},
))
