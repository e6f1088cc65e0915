"""The sparse-attention top-k selection (model.md 2.5.5, 2.13, 5.4): for each row of index scores
(``scores`` B x L, f32, the indexer's logits: -inf for every row a query does not see), the column
indices of the ``min(K, visible)`` largest scores, exact, ties to the lowest index, returned
sorted ascending, -1 in the empty slots (``idx`` B x K, i32). ``visible`` counts the entries above
-inf, so a ragged row is a row whose tail (or any entry) is -inf, as the indexer writes it; a row
of -inf selects nothing. K = 512 (``index_topk``) in V4-Flash and V4.1-Flash; L is the compressed
row count, up to 262,144 (V4 at 1M tokens, ratio 4) and 1,048,576 (V4.1's ratio-1 layers).

A threshold select on the scores' bits, with no sequential round over K.

* **Keys.** A score's f32 bits as an i32, negatives with their 31 low bits flipped, -0.0 as 0.0,
  order as the floats do (-inf lowest, +inf highest; a NaN has an unspecified result).
* **The threshold.** ``need = min(K, visible)``; T, the key of the row's ``need``-th largest
  score, is built two bits at a time from the top, as a radix select does without a histogram:
  16 passes over the row, each counting the visible keys at or above three candidates
  (T + 2^bit, + 2 x 2^bit, + 3 x 2^bit) and keeping the largest that ``need`` keys still reach.
  A pass reads the row in ``W = min(CHUNK, next_pow2(L))``-wide tiles, adding each element's
  three comparisons into per-element counters, one block reduction a candidate a pass (16 x 3 in
  all, against 2K = 1,024 sequential ones in the round-by-round form this replaced). Passes 1-15
  are one device loop (the candidates' step a quarter each pass): unrolled, their 15 copies of the
  count took TileLang 46 s to lower at L = 262,144 and 182 s at L = 101 (two CPU cores,
  2026-12-06); as a loop, 13 s at L = 101.
* **The selection.** One more pass counts the keys above T; the ``need`` selected are those above
  T and the first ``need - above`` equal to it by index (ties to the lowest index). A last pass
  gives each selected element its slot, its exclusive prefix count in index order
  (``dsl.cumsum``, carried across tiles), and stores its index there (a store by an index tile:
  each slot written once), so the list comes out ascending; the slots past the count get -1.

Two forms, ``PHASED`` (the config chooses; the cost model takes the phases for long rows):

* one block a row (default): every pass in one launch, the row's tiles re-read each pass (from
  L2: 1 MB at L = 262,144), each element's comparisons added into per-element counters, one block
  reduction a threshold a pass; a row of up to CHUNK scores is one tile a pass;
* ``PHASED``: a block a tile and a phase a pass (19 launches: the visible count, 16 passes, the
  counts above and at T, the selection), the counts in workspaces; each phase's blocks raise T
  from the previous phase's counts (the same arithmetic in every block, block 0 keeping it), and
  the selection places a tile's indices after those of the tiles before it (exclusive prefix sums
  over the tiles' counts). A long row at a small batch then spreads over the GPU instead of
  streaming 18 times through one SM.

Cost: 18 reads of the row, about 3 compare-adds an element a pass, and two scans a tile in the
selection.

Decode path: each row is selected on its own (``B`` is the batch dimension and dynamic); ``L`` is
specialised (the tile width and count follow it) and padded: a call's scores are padded with -inf
(entries the selection never sees) to L's power-of-two bucket, one build a bucket as a decode's
context grows a row a step (``padded=``, ``codegen/padding.py``).
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register

NEG_INF = float("-inf")
INT_MIN = -(1 << 31)  # the least i32: -0.0's bits, and the least key


@dsl.kernel(batch_dim="B", dynamic=("B",), padded={"L": NEG_INF})
def topk(scores: dsl.Tensor["B", "L", dsl.f32], idx: dsl.Tensor["B", "K", dsl.i32], *,
         TOPK: dsl.Const = 512,
         CHUNK: dsl.Tunable = dsl.choice(4096, 1024, 2048, 8192, also=dsl.SMALLER_POW2),
         PHASED: dsl.Tunable = dsl.boolean(default=False)):
    if not (isinstance(TOPK, int) and TOPK >= 1):
        raise dsl.DslError(f"TOPK {TOPK!r} must be a positive int: the selection's width")
    n, k = scores.L, TOPK
    width = dsl.minimum(CHUNK, dsl.next_pow2(n))  # scores a tile
    tiles = dsl.cdiv(n, width)
    if PHASED:  # a block a tile, a phase a pass: long rows at small batches
        _by_phases(scores, idx, width, tiles, k)
    else:  # a block a row, every pass in it: one launch
        for b in dsl.grid(scores.B):
            _one_block(scores, idx, b, width, tiles, k)


PASSES = 16  # two bits of the key a pass


def _keys(scores, b, t, width):
    """Tile t's keys (the f32 bits, order-preserving as i32) and which are visible (above -inf)."""
    s = dsl.load(scores[b, t * width], (width,), other=NEG_INF)
    bits = dsl.where(s.eq(0.0), 0.0, s).bitcast(dsl.i32)  # -0.0 is 0.0 (a float compare: TVM's
    # simplifier overflows on an i32 compare with the least i32, -0.0's bits)
    return dsl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), s > NEG_INF


def _candidates(top, p):
    """Pass p's thresholds: T + 1, 2, 3 x 2^bit, bit = 30 - 2p (T's lower bits are 0: no i32
    overflow). At pass 0 T is the least i32 and they are constants (3 x 2^30 is not an i32)."""
    bit = 30 - 2 * p
    if p == 0:
        return [dsl.full((1,), c, dsl.i32) for c in (-(1 << 30), 0, 1 << 30)]
    return [top + j * (1 << bit) for j in (1, 2, 3)]


def _raised(top, cands, reached, need):
    """T after a pass: the largest candidate that ``need`` keys still reach, else T."""
    return dsl.where(reached[2] >= need, cands[2], dsl.where(
        reached[1] >= need, cands[1], dsl.where(reached[0] >= need, cands[0], top)))


def _take(scores, idx, b, t, width, top, ties, ties_before, taken_before):
    """Tile t's selected indices stored at their slots: the keys above T, and the ties (keys equal
    to T) whose rank among the row's ties by index is below ``ties``; returns the tile's counts of
    ties and of taken keys."""
    key, live = _keys(scores, b, t, width)
    tie = (live & key.eq(top)).to(dsl.i32)
    take = (live & (key > top)) | (tie.eq(1) & (dsl.cumsum(tie, exclusive=True) + ties_before < ties))
    taken = take.to(dsl.i32)
    slot = dsl.cumsum(taken, exclusive=True) + taken_before
    dsl.store(idx[b, dsl.where(take, slot, -1)], t * width + dsl.arange(width))
    return tie.sum(axis=0), taken.sum(axis=0)


def _empty_slots(idx, b, k, taken, write=None):
    """-1 in the slots from ``taken`` on (slots past K are dropped); ``write``: a (1,) condition."""
    slots = dsl.arange(dsl.next_pow2(k))
    keep = slots >= taken if write is None else (slots >= taken) & write
    dsl.store(idx[b, dsl.where(keep, slots, -1)], dsl.full((dsl.next_pow2(k),), -1, dsl.i32))


def _one_block(scores, idx, b, width, tiles, k):
    """Every pass in the row's block, its tiles re-read each pass (from L2: a row of 262,144 scores
    is 1 MB), each element's comparisons added into per-element counters, one block reduction a
    threshold a pass."""

    def count(*above):  # the row's visible keys at or above each threshold, (1,) each
        sums = [dsl.zeros((width,), dsl.i32) for _ in above]
        for t in dsl.range(tiles):
            key, live = _keys(scores, b, t, width)
            for acc, at in zip(sums, above):
                acc[:] = acc + (live & (key >= at)).to(dsl.i32)
        return [acc.sum(axis=0) for acc in sums]

    (visible,) = count(dsl.full((1,), INT_MIN, dsl.i32))
    need = dsl.minimum(visible, k)
    top = dsl.full((1,), INT_MIN, dsl.i32)  # T, built from the top two bits at a time
    cands = _candidates(top, 0)
    top[:] = _raised(top, cands, count(*cands), need)
    step = dsl.full((1,), 1 << 28, dsl.i32)  # 2^bit of pass 1; a quarter of it each pass after
    for _ in dsl.range(PASSES - 1):  # a device loop: one copy of the count, not fifteen to lower
        cands = [top + step, top + step * 2, top + step * 3]
        top[:] = _raised(top, cands, count(*cands), need)
        step[:] = step >> 2
    (over,) = count(top + 1)  # the keys above T (T + 1 wraps only where nothing is visible)
    ties_before = dsl.zeros((1,), dsl.i32)
    taken_before = dsl.zeros((1,), dsl.i32)
    for t in dsl.range(tiles):
        tie, taken = _take(scores, idx, b, t, width, top, need - over, ties_before, taken_before)
        ties_before[:] = ties_before + tie
        taken_before[:] = taken_before + taken
    _empty_slots(idx, b, k, taken_before)


def _by_phases(scores, idx, width, tiles, k):
    """A row of several tiles: a block a tile, a phase a pass. Each phase's blocks count their tile
    against the pass's thresholds into ``reach``; the next phase's blocks each raise T from those
    counts (the same arithmetic in every block) and block 0 keeps it in ``tops`` for the phase
    after. The last phase places each tile's selected indices after those of the tiles before it
    (exclusive prefix sums over the tiles' counts of keys above T and of ties)."""
    visible = dsl.workspace("visible", (scores.B, tiles), dsl.i32)
    reach = dsl.workspace("reach", (scores.B, PASSES, 3, tiles), dsl.i32)
    tops = dsl.workspace("tops", (scores.B, PASSES), dsl.i32)
    split = dsl.workspace("split", (scores.B, 2, tiles), dsl.i32)  # keys above T, keys equal to T

    def need_of(b):
        return dsl.minimum(dsl.load(visible[b, 0], (tiles,)).sum(axis=0), k)

    def top_after(b, c, p, need):  # T after pass p, from the counts of pass p; block 0 keeps it
        cands = _candidates(None if p == 0 else dsl.load(tops[b, p - 1], (1,)), p)
        # T before pass 0 is the least i32: 2^30 below pass 0's least threshold (no literal: see _keys)
        top = cands[0] - (1 << 30) if p == 0 else dsl.load(tops[b, p - 1], (1,))
        raised = _raised(top, cands, [dsl.load(reach[b, p, j, 0], (tiles,)).sum(axis=0) for j in range(3)], need)
        dsl.store(tops[b, dsl.where((dsl.arange(1) + c).eq(0), dsl.arange(1) + p, -1)], raised)
        return raised

    for b, c in dsl.grid(scores.B, tiles):
        _, live = _keys(scores, b, c, width)
        dsl.store(visible[b, c], live.to(dsl.i32).sum(axis=0))
    for p in range(PASSES):
        for b, c in dsl.grid(scores.B, tiles):
            need = need_of(b)
            top = None if p == 0 else top_after(b, c, p - 1, need)  # pass 0's thresholds are constants
            key, live = _keys(scores, b, c, width)
            for j, at in enumerate(_candidates(top, p)):
                dsl.store(reach[b, p, j, c], (live & (key >= at)).to(dsl.i32).sum(axis=0))
    for b, c in dsl.grid(scores.B, tiles):
        top = top_after(b, c, PASSES - 1, need_of(b))
        key, live = _keys(scores, b, c, width)
        dsl.store(split[b, 0, c], (live & (key > top)).to(dsl.i32).sum(axis=0))
        dsl.store(split[b, 1, c], (live & key.eq(top)).to(dsl.i32).sum(axis=0))
    for b, c in dsl.grid(scores.B, tiles):
        need = need_of(b)
        top = dsl.load(tops[b, PASSES - 1], (1,))
        above, equal = dsl.load(split[b, 0, 0], (tiles,)), dsl.load(split[b, 1, 0], (tiles,))
        ties = need - above.sum(axis=0)
        ties_before = dsl.cumsum(equal, exclusive=True)  # each tile's ties before it, in index order
        taken = above + dsl.minimum(equal, dsl.maximum(ties - ties_before, 0))
        mine = dsl.arange(tiles).eq(c)
        _take(scores, idx, b, c, width, top, ties, dsl.where(mine, ties_before, 0).sum(axis=0),
              dsl.where(mine, dsl.cumsum(taken, exclusive=True), 0).sum(axis=0))
        _empty_slots(idx, b, k, need, write=(dsl.arange(1) + c).eq(0))


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


SMALL = {"CHUNK": 1024}
SPEC = register(Spec(
    kernel=topk,
    reference=topk_reference,
    make_inputs=_inputs,
    outputs=("idx",),
    cases={
        # six rows: none visible, fewer than K, exactly K, K + 1, a random count, all; 3 chunks of 64
        "mixed_k16": {"B": 6, "L": 150, "K": 16, "config": {"CHUNK": 64}},
        "ties_k32": {"B": 4, "L": 300, "K": 32, "values": "ties", "visible": "all", "config": {"CHUNK": 128}},
        "negative_k8": {"B": 3, "L": 77, "K": 8, "values": "negative", "config": {"CHUNK": 32}},
        # the maximum repeated across chunks, equal values around the K-th
        "dup_max_k24": {"B": 3, "L": 500, "K": 24, "values": "dup_max", "visible": "all",
                        "config": {"CHUNK": 64}},
        "all_neg_inf_k4": {"B": 2, "L": 50, "K": 4, "visible": 0, "config": {"CHUNK": 16, "PHASED": True}},
        "fewer_than_k_k64": {"B": 2, "L": 200, "K": 64, "visible": 40, "config": {"CHUNK": 64}},
        "exactly_k_k64": {"B": 2, "L": 200, "K": 64, "visible": 64, "config": {"CHUNK": 64}},
        "scattered_k12": {"B": 4, "L": 257, "K": 12, "values": "scattered", "config": {"CHUNK": 64, "PHASED": True}},
        "extreme_k10": {"B": 3, "L": 400, "K": 10, "values": "extreme", "visible": "all",
                        "config": {"CHUNK": 128}},
        "one_chunk_k5": {"B": 2, "L": 9, "K": 5, "config": {"CHUNK": 1024}},  # fewer scores than a tile
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
    # compare-adds of the passes: the visible count, 16 passes of three thresholds, the count above T
    flops=lambda c: float(c["B"] * c["L"] * (1 + 16 * 3 + 1)),
    bytes_moved=lambda c: 4.0 * c["B"] * (c["L"] + c.get("K", 512)),
    model_shapes=shapes.for_models(topk_shapes),
    sweep={"B": Dim(1, 5, large=64), "L": Dim(1, 400, large=300000), "K": OneOf(4, 7, 16, 33, 64),
           "values": OneOf("normal", "ties", "negative", "dup_max", "scattered", "extreme"),
           "visible": OneOf("mixed", "all", 0, 5),
           "config": {"CHUNK": OneOf(16, 64, 128, 1024), "PHASED": OneOf(False, True)}},
))
