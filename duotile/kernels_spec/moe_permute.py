"""MoE dispatch (model.md 2.6, 5.2 "dispatch/permute"): the router's (token, slot) pairs grouped by
expert, in token order within an expert, for the grouped expert GEMMs.

Input ``topk_ids`` (T x K int32, K = 6: expert ids in [0, E), E = 256 in V4-Flash, 384 in
V4.1-Flash). Pair ``p = t * K + slot``. Outputs:

    counts[e]     pairs choosing expert e                                   (E)
    offsets[e]    sum of counts[:e], the first position of expert e's rows  (E + 1; offsets[E] = the total)
    order[q]      the pair at position q of the grouped list                (T * K)
    where[t, k]   the position of pair (t, k) in that list                  (T x K)

so ``order[where[t, k]] == t * K + k``. Within an expert the pairs keep their flat order (token,
then slot): the list is the stable sort of the pairs by expert, fixed by the inputs alone (no
atomics, no order of arrival). A token that names one expert in two slots (the router never
does; a hash table might) gets two rows of that expert, slot order. A pair whose id lies outside
[0, E) is left out: it is not counted, its ``where`` is -1, and the list's tail past
``offsets[E]`` holds -1 (one per such pair), so a grouped GEMM over ``offsets`` never reads it
and the combine's gather reads a zero row for it.

Three phases, each a grid of its own (``offsets`` needs every count, ``order`` every offset):

0. a block per expert walks the pairs in tiles of ``BT`` tokens and counts its matches;
1. a block per ``BE`` entries of ``offsets``: each lane sums the counts of the experts before it,
   a tile of ``BE`` counts at a time (a lower-triangular compare-and-sum; E + 1 <= 385 entries);
2. a block per expert and one for the out-of-range ids walks the pairs again in order; a match
   at (t, k) goes to ``offsets[e]`` + matches in earlier tiles + in earlier tokens of the tile (a
   lower-triangular sum over the tile's per-token counts) + in earlier slots of its token; it is
   written by scatter stores: ``order[pos] = p`` and ``where[t, k] = pos``.

Each expert reads every pair twice (E x 24,576 pairs at a 4096-token prefill: id tiles stay in L2).
Exact on every target (integer counts). Not batch-invariant by nature: positions depend on every
token of the call. T is dynamic (one build serves every batch), as is the list's length P = T * K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register


@dsl.kernel(dynamic=("T", "P"))
def moe_permute(topk_ids: dsl.Tensor["T", "K", dsl.i32],
                counts: dsl.Tensor["E", dsl.i32], offsets: dsl.Tensor["E1", dsl.i32],
                order: dsl.Tensor["P", dsl.i32], where: dsl.Tensor["T", "K", dsl.i32], *,
                BT: dsl.Tunable = dsl.choice(64, 16, 32, 128),
                BE: dsl.Tunable = dsl.choice(128, 64, 256)):
    n_t, n_k, n_e = topk_ids.T, topk_ids.K, counts.E
    kp = dsl.next_pow2(n_k)  # the slots a tile holds (6 -> 8)
    tiles = dsl.cdiv(n_t, BT)

    def keys(i):
        """Token tile i's expert per pair, (BT, KP): the id in [0, E), E for an id outside it (the
        bucket of pairs left out), -1 past the tensor (padding matches no block)."""
        x = dsl.load(topk_ids[i * BT, 0], (BT, kp), other=-1)
        inside = ((i * BT + dsl.arange(BT))[:, None] < n_t) & (dsl.arange(kp)[None, :] < n_k)
        return dsl.where(inside, dsl.where((x >= 0) & (x < n_e), x, n_e), -1)

    # phase 0: counts
    for e in dsl.grid(n_e):
        total = dsl.zeros((BT,), dsl.i32)  # per token row of the tile, summed over the tiles
        for i in dsl.range(tiles):
            total[:] = total + keys(i).eq(e).to(dsl.i32).sum(axis=1)
        dsl.store(counts[e], total[None, :].sum(axis=1))

    # phase 1: offsets, each lane's sum of the counts before it (offsets[E] = every counted pair)
    for c in dsl.grid(dsl.cdiv(offsets.E1, BE)):
        lanes = dsl.arange(BE)
        before = dsl.zeros((BE,), dsl.i32)
        for j in dsl.range(c + 1):  # the tiles of counts up to this one
            n = dsl.load(counts[j * BE], (BE,), other=0)
            before[:] = before + dsl.where(j * BE + lanes[None, :] < c * BE + lanes[:, None], n[None, :], 0).sum(axis=1)
        dsl.store(offsets[c * BE], before)

    # phase 2: positions; block E places the out-of-range pairs after the counted ones
    for e in dsl.grid(n_e + 1):
        rows, cols = dsl.arange(BT), dsl.arange(kp)
        first = dsl.load(offsets[e], (1,))  # where this block's rows start
        real = (0 * rows + e) < n_e  # an expert's block, or the left-out pairs'
        done = dsl.zeros((BT,), dsl.i32)  # matches in earlier tiles, in every lane
        seen = dsl.zeros((BT,), dsl.i32)  # matches in earlier slots of each token
        for i in dsl.range(tiles):
            hit = keys(i).eq(e).to(dsl.i32)  # (BT, KP)
            per_token = hit.sum(axis=1)
            earlier = dsl.where(rows[None, :] < rows[:, None], per_token[None, :], 0).sum(axis=1)
            seen[:] = 0 * seen
            for k in dsl.range(n_k):
                here = dsl.where(cols[None, :].eq(k), hit, 0).sum(axis=1) > 0  # pair (t, k) matches
                pos = dsl.where(here, first + done + earlier + seen, -1)
                dsl.store(order[pos], dsl.where(real, (i * BT + rows) * n_k + k, -1))
                dsl.store(where[dsl.where(here, i * BT + rows, -1), k], dsl.where(real, pos, -1)[:, None])
                seen[:] = seen + here.to(dsl.i32)
            done[:] = done + dsl.where(rows[:, None] >= 0, per_token[None, :], 0).sum(axis=1)


def moe_permute_reference(topk_ids: torch.Tensor, experts: int) -> dict:
    """The stable sort of the flat pairs by expert id (model.md 5.2), ids outside [0, E) sorted
    last and marked -1."""
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < experts)
    key = torch.where(valid, flat, torch.full_like(flat, experts))
    perm = torch.sort(key, stable=True).indices  # position -> pair
    counts = torch.bincount(flat[valid], minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.long, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    where = torch.empty_like(perm)
    where[perm] = torch.arange(perm.numel(), device=flat.device)
    order = torch.where(valid[perm], perm, torch.full_like(perm, -1))
    where = torch.where(valid, where, torch.full_like(where, -1))
    return {"counts": counts.to(torch.int32), "offsets": offsets.to(torch.int32),
            "order": order.to(torch.int32), "where": where.reshape(topk_ids.shape).to(torch.int32)}


def _ids(case, g: torch.Generator) -> torch.Tensor:
    """``topk_ids`` of one kind: ``router`` (six distinct experts a token, uniform), ``skewed`` (a
    few hot experts, most with no rows), ``one`` (every pair on the last expert), ``repeat``
    (tokens naming an expert twice), ``outside`` (some ids < 0 or >= E), ``ragged`` (counts from 0
    to many: expert e drawn with weight e^2)."""
    t, e, k = case["T"], case["E"], case.get("K", 6)
    kind = case.get("ids", "router")
    if kind == "router":
        return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else \
            torch.empty(0, k, dtype=torch.long)
    if kind == "skewed":
        hot = torch.randperm(e, generator=g)[:max(k, 3)]
        return hot[torch.randint(0, hot.numel(), (t, k), generator=g)]
    if kind == "one":
        return torch.full((t, k), e - 1, dtype=torch.long)
    if kind == "repeat":
        ids = torch.randint(0, e, (t, k), generator=g)
        if k >= 2:
            ids[:, 1] = ids[:, 0]
        if k >= 5:
            ids[::3, 4] = ids[::3, 2]
        return ids
    if kind == "outside":
        ids = torch.randint(0, e, (t, k), generator=g)
        bad = torch.rand(t, k, generator=g) < 0.2
        return torch.where(bad, torch.randint(-3, 3, (t, k), generator=g) + torch.where(
            torch.rand(t, k, generator=g) < 0.5, -3, e + 2), ids)
    if kind == "ragged":
        w = torch.arange(e, dtype=torch.float64) ** 2
        return torch.multinomial(w, t * k, replacement=True, generator=g).reshape(t, k)
    raise ValueError(f"unknown ids kind {kind!r}")


def _inputs(case, device, seed):
    t, e, k = case["T"], case["E"], case.get("K", 6)
    if device.type == "meta":
        ids = torch.empty(t, k, dtype=torch.int32)
    else:
        ids = _ids(case, torch.Generator().manual_seed(seed)).to(torch.int32)
    return {"topk_ids": ids.to(device),
            "counts": torch.full((e,), -7, dtype=torch.int32, device=device),
            "offsets": torch.full((e + 1,), -7, dtype=torch.int32, device=device),
            "order": torch.full((t * k,), -7, dtype=torch.int32, device=device),
            "where": torch.full((t, k), -7, dtype=torch.int32, device=device)}


@dataclass
class _PermuteSpec(Spec):
    """The reference needs E, the size of the ``counts`` output (not an input)."""

    def run_reference(self, inputs, case):
        return moe_permute_reference(inputs["topk_ids"], inputs["counts"].shape[0])


def permute_shapes(m: shapes.ModelDims, decode_t=shapes.DECODE_SAMPLE) -> dict:
    """Each model's experts and top-k at the decode rows ``decode_t`` and a prefill chunk."""
    out = {}
    for phase, t in [*((f"decode{b}", b) for b in decode_t), (f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK)]:
        out[f"{m.short}/e{m.experts}_top{m.experts_per_token}/{phase}"] = {
            "T": t, "E": m.experts, "K": m.experts_per_token, "model": m.name}
    return out


SPEC = register(_PermuteSpec(
    kernel=moe_permute,
    reference=moe_permute_reference,
    make_inputs=_inputs,
    outputs=("counts", "offsets", "order", "where"),
    cases={"t5_e256": {"T": 5, "E": 256}, "t1_e384": {"T": 1, "E": 384},
           "ragged_t77_e256": {"T": 77, "E": 256, "ids": "ragged", "config": {"BT": 16, "BE": 64}},
           "one_expert_t40_e384": {"T": 40, "E": 384, "ids": "one", "config": {"BT": 32}},
           "skewed_t33_e256": {"T": 33, "E": 256, "ids": "skewed"},
           "repeat_t19_e64": {"T": 19, "E": 64, "ids": "repeat", "config": {"BT": 16, "BE": 64}},
           "outside_t23_e128": {"T": 23, "E": 128, "ids": "outside", "config": {"BT": 16}},
           "dspark_top3_e128": {"T": 9, "E": 128, "K": 3}},
    build_cases={"v4_prefill": {"T": 4096, "E": 256}, "v41_decode": {"T": 64, "E": 384}},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    bytes_moved=lambda c: 4.0 * (3 * c["T"] * c.get("K", 6) + 2 * c["E"]),
    model_shapes=shapes.for_models(permute_shapes),
    sweep={"T": Dim(1, 70, large=4099), "E": Dim(1, 140, large=384), "K": OneOf(6, 6, 3, 1),
           "ids": OneOf("router", "skewed", "one", "repeat", "outside", "ragged"),
           "config": {"BT": OneOf(16, 32, 64, 128), "BE": OneOf(64, 128, 256)}},
    sweep_valid=lambda c: c.get("ids", "router") != "router" or c.get("K", 6) <= c["E"],
))
