"""V4.1's candidate pool (model.md 2.13 "hierarchical selection", 5.7): the candidate source
(layer 20, ratio 1) groups each query's index scores into blocks of ``BLOCK`` = 8 consecutive
compressed positions, scores a block by its maximum, forces the block holding the newest visible
position to +inf, keeps the top ``TOPK_BLOCKS`` = 2048 blocks and expands them to positions,
intersected with the visible prefix; the Reindex layers (24, 28, 32, 36) score only that pool.

Inputs: ``scores`` (B x N, f32, one row a query: -inf where invisible) and ``visible`` (B, i32:
the row's visible count, positions ``0 .. visible - 1``). Rules, as the runtime's
``candidate_pool`` (runtime/layers/attention_v41.py) applies them: ties between equal block
scores go to the lowest block index; a block whose scores are all -inf is never kept unless it is
the forced one; a block score is the maximum of the row as given (a finite score past the visible
count still counts, and such a block, once chosen, adds no position); the newest block is not
forced when ``visible`` is 0 or points past the row; -0.0 equals 0.0 and a real +inf ties with
the forced block (the lower index wins the last slot). A block with a NaN is never kept (the
runtime's sort places NaN differently: unspecified).

Outputs, two forms of one pool:

* ``blocks`` (B x KB, i32, KB = TOPK_BLOCKS): the kept blocks that hold a visible position,
  sorted ascending, -1 in the empty slots. A block id j stands for positions ``8j .. 8j + 7``
  below ``visible``: what a restricted indexer gathers (2048 x 8 key rows a query instead of
  every row) before its top-512 (``kernels_spec/topk.py``).
* ``pool`` (B x N, u8), optional: 1 where a position is in the pool, else 0: the runtime's
  boolean pool (``candidate_pool``, the model op ``pick_pool``), for masking a full score row (a
  prefill chunk's Reindex layers). Left out, its phase is not generated: a decode step's Reindex
  layers read the block list alone (``indexer_logits_pool``), and at 1M positions the pool is 1 MB
  a query written for nothing.

Exact selection without sorting: block scores become order-preserving i32 keys (the f32 bits,
negatives with their low 31 bits flipped; -0.0 as 0.0; -inf, NaN and blocks past the row as the
key of -inf, which counts as "not a candidate"), and the cut is the KB-th largest key, found bit by
bit (32 counting passes over the row's keys). Every key above the cut is kept, and of the keys
equal to it the lowest-index ``need = KB - #above`` (fewer than KB candidates: all are kept).
No scatter store: block ids reach their slots by a search.

Five phases (each grid reads what the earlier ones wrote):

0. grid (B, C), C = cdiv(cdiv(N, BLOCK), W): W block maxima a program (BLOCK strided column
   gathers of the row, elementwise max), the newest block forced, keys into ``key`` (B, C, W).
1. grid (B,): the cut, from a sign pass then 31 passes adding one bit each (``count(key >=
   cut + step) >= KB``), over (ROWS, W) tiles of the row's keys; then one pass storing each
   chunk's counts of keys above the cut and at it in the chunks before it (a lower-triangular
   compare-and-sum over a tile's ROWS chunk counts, plus a running total), and ``need``.
2. grid (B, C): ``upto[j]``, the kept blocks at or before block j (a nondecreasing count): the
   keys above the cut up to j plus min(need, the ties up to j), a lower-triangular sum over the
   chunk's W keys plus the chunk's counts.
3. grid (B, cdiv(KB, RT)): slot s of ``blocks`` is the first block j with ``upto[j] > s``: 24
   rounds of a binary search (a gather of ``upto`` a round, RT slots a program; N / BLOCK must be
   below 2^24), -1 where that block holds no visible position or there is none.
4. grid (B, cdiv(N, WM)): ``pool`` at WM positions a program: the block of the position is kept
   (``upto[j] - upto[j - 1]``, two gathers) and the position is below ``visible``.

Counts are f32 sums (integers below 2^24), so every reduction is a float sum; a key compare is an
i32 compare. Cost (not tuned): phases 0, 2 and 4 read the scores, keys and counts once (phase 2
adds a W x W compare a chunk), phase 3 gathers 24 x KB counts a row; phase 1 reads a row's
N / BLOCK keys 33 times in one program (at 1M positions: 131,072 keys, 512 KB, 17 MB in all), which
sets the latency: one SM's read bandwidth, about 0.1 - 0.2 ms a row at 100 - 200 GB/s (an
estimate, not measured; rows run on SMs of their own). A radix pass of several bits would cut it.

Decode path: each row is selected on its own (``B`` is the batch dimension); ``B`` and ``N``
are dynamic, one build serving every batch and context.
"""

from __future__ import annotations

import torch

from .. import dsl
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register

NEG_INF = float("-inf")
INF = float("inf")
KEY_NEG_INF = -2139095041  # the key of -inf: 0xFF800000 with its low 31 bits flipped, as an i32
LOW31 = 0x7FFFFFFF


def _key(x):
    """The order-preserving i32 key of f32 block scores: -0.0 as 0.0, NaN as -inf."""
    x = dsl.where(x > NEG_INF, dsl.where(x.eq(0.0), 0.0, x), NEG_INF)
    bits = x.bitcast(dsl.i32)
    return bits ^ ((bits >> 31) & LOW31)


@dsl.kernel(batch_dim="B", dynamic=("B", "N"))
def candidate_pool(scores: dsl.Tensor["B", "N", dsl.f32], visible: dsl.Tensor["B", dsl.i32],
                   blocks: dsl.Tensor["B", "KB", dsl.i32], pool: dsl.OptionalTensor["B", "N", dsl.u8] = None, *,
                   BLOCK: dsl.Const = 8, TOPK_BLOCKS: dsl.Const = 2048,
                   W: dsl.Tunable = dsl.choice(64, 32, 128, also=dsl.SMALLER_POW2),
                   ROWS: dsl.Tunable = dsl.choice(16, 8, 32, also=dsl.SMALLER_POW2),
                   RT: dsl.Tunable = dsl.choice(256, 128, 512, also=dsl.SMALLER_POW2),
                   WM: dsl.Tunable = dsl.choice(1024, 512, 2048, also=dsl.SMALLER_POW2)):
    for name, v in (("BLOCK", BLOCK), ("TOPK_BLOCKS", TOPK_BLOCKS)):
        if not (isinstance(v, int) and v >= 1):
            raise dsl.DslError(f"{name} {v!r} must be a positive int")
    n_b, n = scores.B, scores.N
    nblk = dsl.cdiv(n, BLOCK)
    chunks = dsl.cdiv(nblk, W)
    key = dsl.workspace("key", (n_b, chunks, W), dsl.i32)  # block c * W + w at [b, c, w]
    cut = dsl.workspace("cut", (n_b, 1), dsl.i32)  # the KB-th largest key (KEY_NEG_INF: fewer candidates)
    need = dsl.workspace("need", (n_b, 1), dsl.f32)  # ties at the cut to keep, lowest index first
    above = dsl.workspace("above", (n_b, chunks), dsl.f32)  # keys above the cut before chunk c
    ties = dsl.workspace("ties", (n_b, chunks), dsl.f32)  # keys at the cut before chunk c
    upto = dsl.workspace("upto", (n_b, chunks * W), dsl.i32)  # kept blocks at or before block j

    for b, c in dsl.grid(n_b, chunks):
        ids = c * W + dsl.arange(W)
        best = dsl.full((W,), NEG_INF, dsl.f32)
        for e in range(BLOCK):  # position BLOCK * id + e of each block: a strided column gather
            best[:] = dsl.maximum(best, dsl.load(scores[b, ids * BLOCK + e], (W,), other=NEG_INF))
        newest = (dsl.load(visible[b], (1,)) - 1) // BLOCK  # < 0 when nothing is visible
        forced = ids.eq(newest) & (ids < nblk)
        dsl.store(key[b, c, 0], _key(dsl.where(forced, INF, best)))

    for b in dsl.grid(n_b):
        _select_cut(key, cut, need, above, ties, b, chunks, TOPK_BLOCKS, ROWS, W)

    for b, c in dsl.grid(n_b, chunks):  # kept up to j: all above the cut, the first `need` at it
        at = dsl.load(cut[b, 0], (1,))[None, :]
        k = dsl.load(key[b, c, 0], (1, W), other=KEY_NEG_INF)
        lanes = dsl.arange(W)
        first = lanes[None, :] <= lanes[:, None]  # [w, w']: w' at or before w
        hi = dsl.where(first & (k > at), 1.0, 0.0).sum(axis=1) + dsl.load(above[b, c], (1,))
        tie = dsl.where(first & k.eq(at) & (at > KEY_NEG_INF), 1.0, 0.0).sum(axis=1) + dsl.load(ties[b, c], (1,))
        dsl.store(upto[b, c * W], (hi + dsl.minimum(tie, dsl.load(need[b, 0], (1,)))).to(dsl.i32))

    for b, t in dsl.grid(n_b, dsl.cdiv(blocks.KB, RT)):  # slot s: the first block j with upto[j] > s
        slot = t * RT + dsl.arange(RT)
        j = dsl.zeros((RT,), dsl.i32)
        step = dsl.full((1,), 1 << 23, dsl.i32)
        for _ in dsl.range(24):  # j: the blocks with upto <= s (upto rises with j; N / BLOCK < 2^24)
            trial = j + step
            j[:] = dsl.where(dsl.load(upto[b, trial - 1], (RT,), other=1 << 30) <= slot, trial, j)
            step[:] = step >> 1
        shown = (j < nblk) & (j * BLOCK < dsl.load(visible[b], (1,)))  # past the last kept: -1
        dsl.store(blocks[b, t * RT], dsl.where(shown, j, -1))

    if pool is None:  # the block list alone (a decode step's Reindex layers read nothing else)
        return
    for b, m in dsl.grid(n_b, dsl.cdiv(n, WM)):
        pos = m * WM + dsl.arange(WM)
        j = pos // BLOCK
        kept = dsl.load(upto[b, j], (WM,), other=0) - dsl.load(upto[b, j - 1], (WM,), other=0)
        dsl.store(pool[b, m * WM], ((kept > 0) & (pos < dsl.load(visible[b], (1,)))).to(dsl.u8))


def _count_at_least(key, b, tiles, rows, w, acc, lo) -> dsl.Tile:
    """How many of row b's keys are at least ``lo`` (a (1, 1) i32 tile), as a (1, 1) f32 tile:
    (rows, w) tiles of keys, counted elementwise into ``acc``, one reduction at the end."""
    acc[:] = 0.0 * acc
    for g in dsl.range(tiles):
        k = dsl.load(key[b, g * rows, 0], (rows, w), other=KEY_NEG_INF)
        acc[:] = acc + dsl.where(k >= lo, 1.0, 0.0)
    return acc.sum(axis=1)[None, :].sum(axis=1)[:, None]


def _select_cut(key, cut, need, above, ties, b, chunks, kb, rows, w) -> None:
    """Phase 1 for row b: the cut (the kb-th largest key, or KEY_NEG_INF), ``need``, and each
    chunk's exclusive counts of keys above the cut and at it."""
    tiles = dsl.cdiv(chunks, rows)
    acc = dsl.zeros((rows, w), dsl.f32)
    at = dsl.full((1, 1), KEY_NEG_INF, dsl.i32)
    step = dsl.full((1, 1), 1 << 30, dsl.i32)
    nonneg = _count_at_least(key, b, tiles, rows, w, acc, 0 * at)
    at[:] = dsl.where(nonneg >= kb, 0 * at, at)  # the cut's half: from there, 31 bits up
    for _ in dsl.range(31):
        trial = at + step
        n_ge = _count_at_least(key, b, tiles, rows, w, acc, trial)
        at[:] = dsl.where(n_ge >= kb, trial, at)
        step[:] = step >> 1
    dsl.store(cut[b, 0], at)
    lanes = dsl.arange(rows)
    lower = lanes[None, :] < lanes[:, None]  # [r, r']: chunk r' before chunk r
    hi_run = dsl.zeros((1,), dsl.f32)
    tie_run = dsl.zeros((1,), dsl.f32)
    for g in dsl.range(tiles):
        k = dsl.load(key[b, g * rows, 0], (rows, w), other=KEY_NEG_INF)
        hi = dsl.where(k > at, 1.0, 0.0).sum(axis=1)  # (rows,): per chunk
        tie = dsl.where(k.eq(at) & (at > KEY_NEG_INF), 1.0, 0.0).sum(axis=1)
        dsl.store(above[b, g * rows], dsl.where(lower, hi[None, :], 0.0).sum(axis=1) + hi_run)
        dsl.store(ties[b, g * rows], dsl.where(lower, tie[None, :], 0.0).sum(axis=1) + tie_run)
        hi_run[:] = hi_run + hi[None, :].sum(axis=1)
        tie_run[:] = tie_run + tie[None, :].sum(axis=1)
    dsl.store(need[b, 0], kb - hi_run)


def candidate_pool_reference(scores: torch.Tensor, visible: torch.Tensor, BLOCK: int = 8,
                             TOPK_BLOCKS: int = 2048) -> dict:
    """model.md 2.13, per row: blocks of BLOCK positions scored by their maximum (past the row:
    -inf), the block holding position visible - 1 scored +inf, blocks ranked by score descending
    and then by index (a stable sort), the first TOPK_BLOCKS of them whose score is above -inf
    kept; ``blocks``: the kept ones with a position below ``visible``, ascending, -1 after them;
    ``pool``: the kept blocks' positions below ``visible``."""
    rows, n = scores.shape
    dev = scores.device
    nblk = -(-n // BLOCK)
    padded = torch.full((rows, nblk * BLOCK), NEG_INF, dtype=torch.float32, device=dev)
    padded[:, :n] = scores.float()
    bscore = padded.view(rows, nblk, BLOCK).amax(-1)
    bscore = torch.where(bscore == 0, torch.zeros_like(bscore), bscore)  # -0.0 ranks as 0.0
    vis = visible.to(dev).long()
    ids = torch.arange(nblk, device=dev)
    newest = torch.div(vis - 1, BLOCK, rounding_mode="floor")
    bscore = torch.where((ids[None, :] == newest[:, None]) & (vis[:, None] > 0), INF, bscore)
    order = torch.sort(-bscore, dim=-1, stable=True).indices[:, :TOPK_BLOCKS]  # -(-inf) = +inf: last
    good = (bscore.gather(1, order) > NEG_INF) & (order * BLOCK < vis[:, None])
    kept = torch.where(good, order, torch.full_like(order, nblk)).sort(-1).values  # dropped: nblk, last
    out = torch.full((rows, TOPK_BLOCKS), -1, dtype=torch.int32, device=dev)
    width = kept.shape[1]
    out[:, :width] = torch.where(kept < nblk, kept, torch.full_like(kept, -1)).to(torch.int32)
    flags = torch.zeros(rows, nblk + 1, dtype=torch.bool, device=dev)
    flags.scatter_(1, kept, True)
    pos = torch.arange(n, device=dev)
    pool = flags[:, :nblk].repeat_interleave(BLOCK, 1)[:, :n] & (pos[None, :] < vis[:, None])
    return {"blocks": out, "pool": pool.to(torch.uint8)}


def _visible(case, rows: int, g: torch.Generator) -> list[int]:
    """Each row's visible count. "mixed" cycles through none, one, a block's end, the middle of a
    block, a random count, the whole row and past the row (the newest block then lies past it:
    nothing is forced); "all": the whole row; an int: that many in every row (capped at N)."""
    n, block, kind = case["N"], case.get("BLOCK", 8), case.get("visible", "mixed")
    if kind == "all":
        return [n] * rows
    if isinstance(kind, int):
        return [min(kind, n)] * rows
    cycle = [0, 1, min(n, 3 * block), min(n, 2 * block + block // 2 + 1), None, n, n + block + 1]
    return [int(torch.randint(0, n + 1, (1,), generator=g)) if v is None else v
            for v in (cycle[r % len(cycle)] for r in range(rows))]


def _values(kind: str, b: int, n: int, g: torch.Generator, device) -> torch.Tensor:
    """Scores of one kind: ``normal`` (N(0, 1)), ``ties`` (five values: many equal block maxima,
    ties to the lowest block), ``scattered`` (a third of the entries -inf anywhere: blocks that are
    all -inf), ``sparse`` (all -inf but about one entry in 40: fewer candidates than blocks kept),
    ``extreme`` (magnitudes 2^-100 .. 2^100 of either sign, -0.0 beside 0.0, a few +inf that tie
    with the forced block)."""
    x = torch.randn(b, n, generator=g, device=device)
    if kind == "normal":
        return x
    if kind == "ties":
        return torch.randint(-2, 3, (b, n), generator=g, device=device).float() * 0.5
    if kind in ("scattered", "sparse"):
        keep = 1 / 40 if kind == "sparse" else 2 / 3
        return x.masked_fill(torch.rand(b, n, generator=g, device=device) >= keep, NEG_INF)
    if kind == "extreme":
        e = torch.randint(-100, 101, (b, n), generator=g, device=device).float()
        x = torch.sign(x) * torch.exp2(e)
        x[:, ::5] = 0.0
        x[:, 2::10] = -0.0
        x[:, 3::97] = INF
        return x
    raise ValueError(f"unknown score kind {kind!r}")


def _inputs(case, device, seed):
    b, n, kb = case["B"], case["N"], case.get("KB", 2048)
    out = {"blocks": torch.full((b, kb), -7, dtype=torch.int32, device=device),
           "pool": torch.full((b, n), 7, dtype=torch.uint8, device=device)}
    if device.type == "meta":
        return {"scores": torch.empty(b, n, dtype=torch.float32, device=device),
                "visible": torch.empty(b, dtype=torch.int32, device=device), **out}
    # model-sized rows (4096 x 1M scores) are drawn where they are used: a CUDA generator on a GPU
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    g = torch.Generator(device=gen_device).manual_seed(seed)
    x = _values(case.get("values", "normal"), b, n, g, gen_device)
    visible = torch.tensor(_visible(case, b, torch.Generator().manual_seed(seed)), dtype=torch.int32)
    if case.get("masked", True):  # as the indexer writes them: -inf past the visible count
        x = x.masked_fill(torch.arange(n, device=gen_device)[None, :] >= visible.to(gen_device)[:, None], NEG_INF)
    return {"scores": x.to(device), "visible": visible.to(device), **out}


def pool_shapes(m: shapes.ModelDims) -> dict[str, dict]:
    """The candidate source's pool (V4.1 only: V4-Flash has none) over its ratio-1 index scores,
    N = context positions: decode at every batch at a 1M context, 16 sequences at 4K and 64K, and
    a prefill chunk of 4096 queries (the runtime runs every layer on every prompt token) at 4K, 64K
    and 1M. B and N are dynamic: one build serves them all."""
    if not m.candidate_topk_blocks:
        return {}
    rows = [(f"decode{b}", b, shapes.CONTEXT) for b in shapes.DECODE_BATCHES]
    rows += [("decode16", 16, 1 << 12), ("decode16", 16, 1 << 16)]
    rows += [(f"prefill{shapes.PREFILL_CHUNK}", shapes.PREFILL_CHUNK, ctx)
             for ctx in (1 << 12, 1 << 16, shapes.CONTEXT)]
    out = {}
    for phase, b, context in rows:
        label = f"{context >> 20}m" if context >= 1 << 20 else f"{context >> 10}k"
        out[f"{m.short}/r1_ctx{label}/{phase}"] = {"B": b, "N": context, "KB": m.candidate_topk_blocks,
                                                   "BLOCK": m.candidate_block, "model": m.name}
    return out


def _constants(case) -> dict:
    return {"BLOCK": case.get("BLOCK", 8), "TOPK_BLOCKS": case.get("KB", 2048)}


SMALL = {"W": 16, "ROWS": 4, "RT": 8, "WM": 64}
SPEC = register(Spec(
    kernel=candidate_pool,
    reference=candidate_pool_reference,
    make_inputs=_inputs,
    outputs=("blocks", "pool"),
    cases={
        # seven rows: none visible, one, a block's end, mid-block, random, all, past the row
        "mixed_kb6": {"B": 7, "N": 300, "KB": 6, "config": SMALL},
        "ties_kb5": {"B": 4, "N": 250, "KB": 5, "values": "ties", "visible": "all", "config": SMALL},
        "scattered_kb8": {"B": 7, "N": 333, "KB": 8, "values": "scattered", "config": SMALL},
        "sparse_kb12": {"B": 3, "N": 400, "KB": 12, "values": "sparse", "visible": "all", "config": SMALL},
        "extreme_kb7": {"B": 3, "N": 260, "KB": 7, "values": "extreme", "visible": "all", "config": SMALL},
        "all_neg_inf_kb4": {"B": 2, "N": 50, "KB": 4, "visible": 0, "config": SMALL},
        # finite scores past the visible count: they score blocks that add no position
        "unmasked_kb6": {"B": 7, "N": 200, "KB": 6, "masked": False, "config": SMALL},
        "fewer_blocks_kb64": {"B": 3, "N": 90, "KB": 64, "config": SMALL},  # 12 blocks: all candidates kept
        "block4_kb3": {"B": 4, "N": 61, "KB": 3, "BLOCK": 4, "values": "ties",
                       "config": {"W": 8, "ROWS": 2, "RT": 4, "WM": 32}},
        # the model's block and pool on a short row: 2,500 blocks, several threshold tiles
        "model_kb2048": {"B": 2, "N": 20000, "KB": 2048, "visible": "all",
                         "config": {"W": 64, "ROWS": 16, "RT": 256, "WM": 1024}},
    },
    build_cases={"v41_ctx1m_decode16": {"B": 16, "N": 1 << 20, "KB": 2048}},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    constants_of=_constants,
    # compare-counts: 33 passes over the block keys, the W x W slot sums, the block maxima
    flops=lambda c: float(c["B"] * (c["N"] + 33 * c["N"] / c.get("BLOCK", 8) + 64 * c["N"] / c.get("BLOCK", 8))),
    bytes_moved=lambda c: c["B"] * (4.0 * c["N"] + 1.0 * c["N"] + 4.0 * c.get("KB", 2048) + 4),
    model_shapes=shapes.for_models(pool_shapes),
    sweep={"B": Dim(1, 8, large=64), "N": Dim(1, 400, large=300000), "KB": OneOf(1, 3, 4, 9, 16, 64),
           "BLOCK": OneOf(8, 8, 4, 1), "values": OneOf("normal", "ties", "scattered", "sparse", "extreme"),
           "visible": OneOf("mixed", "all", 0, 7), "masked": OneOf(True, True, False),
           "config": {"W": OneOf(8, 16, 64), "ROWS": OneOf(2, 4, 16), "RT": OneOf(4, 16, 256),
                      "WM": OneOf(32, 256, 1024)}},
))
