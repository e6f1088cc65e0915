"""The sparse-attention top-k selection (model.md 2.5.5, 2.13, 5.4): for each row of index scores
(``scores`` B x L, f32, the indexer's logits: -inf for every row a query does not see), the column
indices of the ``min(K, visible)`` largest scores, exact, ties to the lowest index, returned
sorted ascending, -1 in the empty slots (``idx`` B x K, i32). ``visible`` counts the entries above
-inf, so a ragged row is a row whose tail (or any entry) is -inf, as the indexer writes it; a row
of -inf selects nothing. K = 512 (``index_topk``) in V4-Flash and V4.1-Flash; L is the compressed
row count, up to 262,144 (V4 at 1M tokens, ratio 4) and 1,048,576 (V4.1's ratio-1 layers).

Two phases, no new DSL op:

0. grid (B, C): block (b, c) takes chunk c of row b, ``W = min(CHUNK, next_pow2(L))`` scores
   (past L reads -inf), and selects its top ``min(K, W)`` by rounds of "the largest live score
   ``m``, then the lowest index whose score equals ``m`` (a min over ``where(s == m, index,
   BIG)``), then that one leaves (its score becomes -inf)". Round i writes (m, index) into slot i
   of two K-wide buffers (``buf[:] = where(arange(K) == i, value, buf)``) in the workspaces
   ``cand_v`` / ``cand_i``, so each chunk's list is sorted by (score descending, index
   ascending); a round that finds only -inf writes (-inf, BIG): an empty slot.
1. grid (B,): a K-way merge of the row's C lists. A pointer per list; each of K rounds gathers the
   C list heads (``next_pow2(C)`` wide; lists past the last read -inf), takes the best by the same
   order (max score, then min index: a real index is in one list only, so one list matches) and
   advances that list; round i's pick is the row's i-th best. Each round also keeps every pick's
   rank by index, rank_i = #{picks j : x_j < x_i} (the new pick's by a sum over the earlier ones,
   the earlier ones' by one more where the new pick is smaller). Output slot p then takes the pick
   of rank p (a max over ``where(rank == p, x, -1)``, ``RT`` slots at a time); the empty picks
   (BIG, all of rank = the count of real picks) give -1.

Indices are carried as f32 (exact below 2^24, and ``L`` must be below it; BIG = 2^24), so that
every reduction is a float max / min / sum, which every target lowers. Ties are decided on the
float value as stored: -0.0 equals 0.0, +inf is a score like any other. A NaN score has an
unspecified result.

Cost (correctness first, not tuned): phase 0 runs ``min(K, W)`` sequential rounds a block, each
reading the W-wide tile twice (a max, a min) and writing it once: K * L compare-selects a row in
all, over C = cdiv(L, W) blocks a row (at K = 512, L = 1M, CHUNK = 4096: 512 rounds over 4096
scores in each of 256 blocks, 5.4e8 element steps a row). Phase 1 is K sequential rounds of a
C-wide gather and three reductions (the rank's sum over K picks) a row, then K^2 comparisons
for the output slots. The K dependent
block reductions of phases 0 and 1 set the latency (about 2K = 1024 block-wide reductions in
sequence), not bandwidth; a radix / threshold select would cut them to a few dozen passes.

Decode path: each row is selected on its own (``B`` is the batch dimension and dynamic); ``L`` is
specialised (the chunk and merge widths follow it) and padded: a call's scores are padded with -inf
(entries the selection never sees) to L's power-of-two bucket, one build a bucket as a decode's
context grows a row a step (``padded=``, ``codegen/padding.py``).
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register

NEG_INF = float("-inf")
BIG = float(1 << 24)  # the index of an empty slot: above every real index (L < 2^24), exact in f32


@dsl.kernel(batch_dim="B", dynamic=("B",), padded={"L": NEG_INF})
def topk(scores: dsl.Tensor["B", "L", dsl.f32], idx: dsl.Tensor["B", "K", dsl.i32], *,
         TOPK: dsl.Const = 512,
         CHUNK: dsl.Tunable = dsl.choice(4096, 1024, 2048, 8192, also=dsl.SMALLER_POW2),
         RT: dsl.Tunable = dsl.choice(16, 8, 32)):
    if not (isinstance(TOPK, int) and TOPK >= 1):
        raise dsl.DslError(f"TOPK {TOPK!r} must be a positive int: the selection's width")
    n, k = scores.L, TOPK
    kp = dsl.next_pow2(k)  # the lists' width: a register tile a whole multiple of the threads
    width = dsl.minimum(CHUNK, dsl.next_pow2(n))  # scores a chunk: one tile
    chunks = dsl.cdiv(n, width)
    heads = dsl.next_pow2(chunks)  # the merge's gather of list heads, a power of two wide
    cand_v = dsl.workspace("cand_v", (scores.B, chunks * kp), dsl.f32)  # chunk c's list at c * kp
    cand_i = dsl.workspace("cand_i", (scores.B, chunks * kp), dsl.f32)

    for b, c in dsl.grid(scores.B, chunks):
        ids = (c * width + dsl.arange(width)).to(dsl.f32)[None, :]
        live = dsl.empty((1, width), dsl.f32)
        live[:] = dsl.load(scores[b, c * width], (1, width), other=NEG_INF)
        vals = dsl.full((1, kp), NEG_INF, dsl.f32)  # slots past K stay empty
        inds = dsl.full((1, kp), BIG, dsl.f32)
        for i in dsl.range(dsl.minimum(k, width)):
            top = live.max(axis=1)[:, None]
            at = dsl.where(live.eq(top), ids, BIG).min(axis=1)[:, None]  # ties: the lowest index
            vals[:] = dsl.where(dsl.arange(kp)[None, :].eq(i), top, vals)
            inds[:] = dsl.where(dsl.arange(kp)[None, :].eq(i), dsl.where(top > NEG_INF, at, BIG), inds)
            live[:] = dsl.where(ids.eq(at), NEG_INF, live)
        dsl.store(cand_v[b, c * kp], vals)
        dsl.store(cand_i[b, c * kp], inds)

    for b in dsl.grid(scores.B):
        ptr = dsl.zeros((1, heads), dsl.i32)  # the next entry of each chunk's list
        picks = dsl.full((1, kp), BIG, dsl.f32)  # round i's pick in slot i
        slots = dsl.arange(kp)[None, :]
        rank = dsl.empty((1, kp), dsl.f32)  # #{picks j so far : x_j < x_i}; slots past K: none wanted
        rank[:] = dsl.where(slots < k, 0.0, BIG)
        for i in dsl.range(k):
            at = dsl.arange(heads)[None, :] * kp + ptr  # lists past the last chunk read past the row
            hv = dsl.load(cand_v[b, at], (1, heads), other=NEG_INF)
            hi = dsl.load(cand_i[b, at], (1, heads), other=BIG)
            top = hv.max(axis=1)[:, None]
            best = dsl.where(hv.eq(top), hi, BIG).min(axis=1)[:, None]
            ptr[:] = dsl.where(hv.eq(top) & hi.eq(best), ptr + 1, ptr)
            below = dsl.where((slots < i) & (picks < best), 1.0, 0.0).sum(axis=1)[:, None]
            rank[:] = dsl.where(slots.eq(i), below, rank + dsl.where((slots < i) & (picks > best), 1.0, 0.0))
            picks[:] = dsl.where(slots.eq(i), best, picks)
        for t in dsl.range(dsl.cdiv(k, RT)):  # output slots t * RT ..: the pick of that rank
            want = (t * RT + dsl.arange(RT)).to(dsl.f32)[:, None]
            got = dsl.where(rank.eq(want), picks, -1.0).max(axis=1)
            dsl.store(idx[b, t * RT], dsl.where(got < BIG, got, -1.0)[None, :].to(dsl.i32))


def topk_reference(scores: torch.Tensor, TOPK: int = 512) -> dict:
    """model.md 2.5.5: per row, the entries above -inf ranked by score (descending), ties by index
    (ascending: a stable sort of the negated scores); the first min(TOPK, visible) of them, their
    indices sorted ascending, then -1 up to TOPK."""
    rows, n = scores.shape
    out = torch.full((rows, TOPK), -1, dtype=torch.int32, device=scores.device)
    if n == 0:
        return {"idx": out}
    order = torch.sort(-scores.float(), dim=-1, stable=True).indices[:, :TOPK]  # -(-inf) = +inf: last
    taken = scores.gather(-1, order) > NEG_INF
    chosen = torch.where(taken, order, torch.full_like(order, n)).sort(-1).values  # not taken: n, last
    width = chosen.shape[1]
    out[:, :width] = torch.where(chosen < n, chosen, torch.full_like(chosen, -1)).to(torch.int32)
    return {"idx": out}


def _visible(case, rows: int, g: torch.Generator) -> list[int]:
    """Each row's count of entries above -inf. ``visible`` "mixed" cycles through none, fewer than
    K, exactly K, one more than K, a random count and the whole row; "all": the whole row; an int:
    that many in every row (capped at L)."""
    n, k, kind = case["L"], case.get("K", 512), case.get("visible", "mixed")
    if kind == "all":
        return [n] * rows
    if isinstance(kind, int):
        return [min(kind, n)] * rows
    cycle = [0, max(0, k // 2 - 1), k, k + 1, None, n]
    out = []
    for r in range(rows):
        v = cycle[r % len(cycle)]
        out.append(int(torch.randint(0, n + 1, (1,), generator=g)) if v is None else min(v, n))
    return out


def _values(kind: str, b: int, n: int, k: int, g: torch.Generator, device) -> torch.Tensor:
    """Scores of one kind: ``normal`` (N(0, 1)), ``ties`` (five values: most picks are ties the
    lowest index wins), ``negative`` (every score below 0), ``dup_max`` (N(0, 1) with the row's
    largest value repeated in several chunks and a block of equal values around the K-th),
    ``scattered`` (N(0, 1) with a third of the entries -inf anywhere in the row, as V4.1's
    candidate pool leaves them), ``extreme`` (magnitudes 2^-100 .. 2^100 of either sign, -0.0
    beside 0.0, and a few +inf)."""
    x = torch.randn(b, n, generator=g, device=device)
    if kind == "normal":
        return x
    if kind == "ties":
        return torch.randint(-2, 3, (b, n), generator=g, device=device).float() * 0.5
    if kind == "negative":
        return -x.abs() - 1.0
    if kind == "dup_max":
        top = x.amax(-1, keepdim=True) + 1.0
        step = max(1, n // 7)
        x[:, ::step] = top  # the maximum in about 7 places, spread over the row
        x[:, 1::max(1, n // max(1, k // 2))] = 0.25  # a tie around the K-th pick
        return x
    if kind == "scattered":
        return x.masked_fill(torch.rand(b, n, generator=g, device=device) < 1 / 3, NEG_INF)
    if kind == "extreme":
        e = torch.randint(-100, 101, (b, n), generator=g, device=device).float()
        x = torch.sign(x) * torch.exp2(e)
        x[:, ::5] = 0.0
        x[:, 2::10] = -0.0
        x[:, 3::97] = float("inf")
        return x
    raise ValueError(f"unknown score kind {kind!r}")


def _inputs(case, device, seed):
    b, n, k = case["B"], case["L"], case.get("K", 512)
    out = {"idx": torch.full((b, k), -7, dtype=torch.int32, device=device)}
    if device.type == "meta":
        return {"scores": torch.empty(b, n, dtype=torch.float32, device=device), **out}
    # model-sized rows (64 x 1M scores) are drawn where they are used: a CUDA generator on a GPU
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    g = torch.Generator(device=gen_device).manual_seed(seed)
    x = _values(case.get("values", "normal"), b, n, k, g, gen_device)
    visible = torch.tensor(_visible(case, b, torch.Generator().manual_seed(seed)), device=gen_device)
    x = x.masked_fill(torch.arange(n, device=gen_device)[None, :] >= visible[:, None], NEG_INF)
    return {"scores": x.to(device), **out}


def topk_shapes(m: shapes.ModelDims) -> dict[str, dict]:
    """Decode selection over the scores of each index ratio of the model (V4: 4; V4.1: 2 and 1),
    L = context / ratio: 16 sequences at contexts of 4K and 64K tokens, and 1, 16 and 64 sequences
    at 1M (a build's code depends on L, not on the batch). V4.1's ratio 1 also at 256K: as many
    rows as V4 at 1M (262,144), so one build serves both models' representative shape."""
    ratios = (4,) if m.name == "v4-flash" else (2, 1)
    out: dict[str, dict] = {}
    for ratio in ratios:
        contexts = [(4096, (16,)), (1 << 16, (16,)), (shapes.CONTEXT, (1, 16, 64))]
        if ratio == 1:
            contexts.insert(2, (1 << 18, (16,)))
        for context, batches in contexts:
            label = f"{context >> 20}m" if context >= 1 << 20 else f"{context >> 10}k"
            for b in batches:
                out[f"{m.short}/r{ratio}_ctx{label}/decode{b}"] = {
                    "B": b, "L": context // ratio, "K": m.index_topk, "model": m.name}
    return out


SMALL = {"CHUNK": 1024, "RT": 8}
SPEC = register(Spec(
    kernel=topk,
    reference=topk_reference,
    make_inputs=_inputs,
    outputs=("idx",),
    cases={
        # six rows: none visible, fewer than K, exactly K, K + 1, a random count, all; 3 chunks of 64
        "mixed_k16": {"B": 6, "L": 150, "K": 16, "config": {"CHUNK": 64, "RT": 8}},
        "ties_k32": {"B": 4, "L": 300, "K": 32, "values": "ties", "visible": "all", "config": {"CHUNK": 128}},
        "negative_k8": {"B": 3, "L": 77, "K": 8, "values": "negative", "config": {"CHUNK": 32, "RT": 8}},
        # the maximum repeated across chunks, equal values around the K-th
        "dup_max_k24": {"B": 3, "L": 500, "K": 24, "values": "dup_max", "visible": "all",
                        "config": {"CHUNK": 64, "RT": 8}},
        "all_neg_inf_k4": {"B": 2, "L": 50, "K": 4, "visible": 0, "config": {"CHUNK": 16, "RT": 8}},
        "fewer_than_k_k64": {"B": 2, "L": 200, "K": 64, "visible": 40, "config": {"CHUNK": 64}},
        "exactly_k_k64": {"B": 2, "L": 200, "K": 64, "visible": 64, "config": {"CHUNK": 64}},
        "scattered_k12": {"B": 4, "L": 257, "K": 12, "values": "scattered", "config": {"CHUNK": 64, "RT": 8}},
        "extreme_k10": {"B": 3, "L": 400, "K": 10, "values": "extreme", "visible": "all",
                        "config": {"CHUNK": 128, "RT": 8}},
        "one_chunk_k5": {"B": 2, "L": 9, "K": 5, "config": {"CHUNK": 1024, "RT": 8}},  # fewer scores than a tile
        # K not a power of two at the user's config: the lists are padded to 64 slots (a CUDA build once
        # refused a 16 x 33 register tile over 256 threads)
        "odd_k33": {"B": 3, "L": 700, "K": 33, "values": "dup_max", "visible": "mixed"},
        # the models' K on a short row: two chunks of 1024, every row sees more than K
        "model_k512": {"B": 2, "L": 1500, "K": 512, "visible": "all", "config": SMALL},
    },
    build_cases={"v4_1m_decode16": {"B": 16, "L": 262144, "K": 512}},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    constants_of=lambda case: {"TOPK": case.get("K", 512)},
    # compare-selects of the rounds (phase 0: K over each chunk; the merge; the K x K ordering)
    flops=lambda c: float(c["B"] * (c.get("K", 512) * c["L"] + 2 * c.get("K", 512) ** 2)),
    bytes_moved=lambda c: 4.0 * c["B"] * (c["L"] + c.get("K", 512)),
    model_shapes=shapes.for_models(topk_shapes),
    sweep={"B": Dim(1, 5, large=64), "L": Dim(1, 400, large=300000), "K": OneOf(4, 7, 16, 33, 64),
           "values": OneOf("normal", "ties", "negative", "dup_max", "scattered", "extreme"),
           "visible": OneOf("mixed", "all", 0, 5),
           "config": {"CHUNK": OneOf(16, 64, 128, 1024), "RT": OneOf(8, 16)}},
))
