"""Sparse decode attention with an attention sink (model.md 2.5.6, 2.13, 5.4): one query token per
sequence, ``H`` heads sharing one K = V row per selected position (MQA: 64 heads x 512 in both
V4-Flash and V4.1-Flash). The rows are gathered from the sequence's cache ``kv`` (B, N, D) by its
index list ``idx`` (B, L): window slots and the selected (CSA, V4.1) or all visible (HCA)
compressed rows, merged into one list padded with -1. For head h of sequence b

    l_j  = (q_h . kv[b, idx_j]) * D^-0.5                 over the live slots j (0 <= idx_j < N)
    o_h  = sum_j exp(l_j) kv[b, idx_j] / (exp(sink_h) + sum_j exp(l_j))
    lse_h = log(exp(sink_h) + sum_j exp(l_j))            (natural log, the whole denominator)

A slot of -1 (or any index outside the cache) takes no part in the softmax: its score is -inf,
not that of a zero row. A repeated index counts as often as it is listed. The sink is a
value-less logit: with no live slot the softmax is over the sink alone, so ``o`` is 0 and ``lse``
is ``sink_h``. ``lse`` is optional (leave it out and it is not computed).

Split: ``SPLIT`` cuts the index list into contiguous ranges of ``BN``-slot blocks; phase 0 runs
a block per (sequence, range), an online softmax (base 2) over its slots, and writes the range's
normalised output and base-2 log-sum-exp (its max and sum folded in one number) into
workspaces; phase 1 combines the ranges of a sequence in range order, ``BD`` output columns a
block, with the sink's ``2^(sink log2 e - top)`` added once to the denominator. A range without
live slots writes zeros and an LSE of -inf, which weighs nothing. The order depends on ``L`` and
``SPLIT`` only, never on the batch: no atomics, so a sequence's bits are the same at every batch
size. ``SPLIT = 1`` is one phase, its online softmax started from the sink (max ``sink log2 e``,
sum 1, output 0). A head whose running max is still -inf subtracts 0 instead, so blocks of dead
slots give weights of 0, not NaN.

Precision: the P V gemm takes the probabilities in two BF16 parts (``p_hi`` and the rounding of
``p - p_hi``: about 2^-16 of each p left, against 2^-9 for one BF16 rounding). On the tiny models'
attention calls (2026-12-02, the interpreter) the output before its BF16 rounding then sits within
2e-6 of the FP32 reference, where one BF16 P left 3e-3.

Tolerance (``_error_bound``): the reference runs in float64. The bound still admits a one-part P
(relative 2^-9 each, while the denominator sums them unrounded) and the bf16 output (2^-9
relative), so |o - ref|_c <= 2^-9 sum_j p_j |v_jc| + 2^-9 |ref_c| plus f32 noise; the bound takes
twice both terms. The scores' f32 sums (D products, exact bf16 products)
move ``lse`` by at most 2 (D + 4) 2^-24 max_j sum_c |q_c k_jc| D^-0.5; the bound adds 2^-20
relative for the base-2 log and exp on the targets.

Epilogue (optional, ``decode_epilogue.Epilogue``): given ``positions`` (B, i32) and the layer's ``cos`` / ``sin``
tables (P x ROPE / 2, f32, as ``kv_insert`` takes them; ROPE = twice their columns, or V4's row
constant), the stored output's last ROPE channels are rotated by -P (model.md 2.4, 2.5.6), what the
grouped output projection ``wo_a`` takes. Order, as the runtime's ``act(rope(act(o), P,
inverse=True))``: the output rounded to bf16, then per pair (a, b) in f32 ``a cos + b sin`` (even
channel) and ``b cos - a sin`` (odd), then rounded to bf16; on the interpreter the bits of
``Rotary.apply(..., inverse=True)``. A position outside the table reads cos = sin = 0: its rope
channels are 0. Tolerance (``_rotated_bound``): 2^-7 (|cos| A_c + |sin| A_partner), A_c =
sum_j p_j |v_jc| (the plain bound carried through the rotation plus one more bf16 rounding).
Without the epilogue's inputs the kernel is the plain one, source for source.

Model shapes (model.md 2.5.8, 3.3): rows per query 640 (CSA / CSA2: window + top-512) and,
V4 HCA at 1M tokens, 128 + 8,192 = 8,320 (every visible compressed row); decode batches 1, 16 and
64. ``B``, ``L`` and ``N`` are dynamic, so an SWA layer's 128 slots run the same build. ``N``, the
cache rows of a sequence, only bounds the gather: the window ring plus the compressed rows at a
64K context for the top-k lists (128 + 16,384 for ratio 4, 128 + 32,768 for ratio 2), the list
itself for HCA.
"""

from __future__ import annotations

import math

import torch

from .. import dsl
from . import model_shapes as shapes
from .column_groups import column_groups
from .decode_epilogue import epilogue_inputs, epilogue_of, inverse_rope, rope_phase, rotated_bound
from .decode_fp8_out import DERIVED, fp8_out_constants, fp8_out_inputs, fp8_out_of, quant_phase
from .gemm_f32 import bf16_parts
from .registry import Dim, OneOf, Spec, register

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = float("-inf")


# the head tile has at least this many rows: fewer heads (a small model's 4) are padded with zero
# queries whose rows are never stored, so the score and output gemms keep a tensor-core tile's
# height (a 4-row accumulator cannot be split over the warps that share one tile)
MIN_HEAD_ROWS = 64


def _head_rows(q):
    return dsl.maximum(q.H, MIN_HEAD_ROWS)


def _attend(q, kv, idx, b, lo, hi, BN, STAGES, kv_rows=None, rows_total=None, columns=None, own=None):
    """Online softmax of the heads of query b (a sequence's token) over the slot blocks lo .. hi-1:
    (accs, row_max, row_sum), the output not yet divided by row_sum (a tile a column group), in
    base-2 units; row_max is -inf and row_sum 0 for a head that met no live slot. Rows past the
    heads (``_head_rows``) are zero queries.

    ``kv_rows(rows)`` gathers the named rows (BN, D) from the cache, by default sequence b's own
    (``kv[b, rows, 0]``), or a tuple of (BN, D) tiles whose sum is the rows (rows kept in two
    tensors: each slot's row in one, zeros in the other); a slot is live below ``rows_total``, by
    default ``kv``'s N. ``kv_rows`` may also be a list of segments ``(first block, end block or
    None, gather, rows)``: the list's blocks in [first, end) gathered by their own ``gather`` and
    live below their own ``rows`` (a list whose first slots name one tensor's rows and the rest
    another's: one operand a block). ``columns``, (first column, width) pairs that tile D, splits
    a row by columns (rows whose channels are stored in two formats): a gather then gives a tile
    or a tuple for each group, the scores sum the groups' products and each group has its own
    accumulator. ``own``, where given, replaces ``lo`` / ``hi`` by the query's own range read from
    data (``own_ranges``)."""
    H, D = _head_rows(q), q.D
    groups = columns or ((0, D),)
    q_tiles = [dsl.load(q[b, 0, first], (H, width), role="operand") for first, width in groups]
    accs = [dsl.zeros((H, width), dsl.f32, role="accumulator") for _, width in groups]
    default = [(0, None, kv_rows, kv.N if rows_total is None else rows_total)]
    segments = kv_rows if isinstance(kv_rows, list) else default
    row_max = dsl.full((H,), NEG_INF, dsl.f32)
    row_sum = dsl.zeros((H,), dsl.f32)
    scale = LOG2E * D ** -0.5
    for first, end, gather, live_below in segments:
        for n, length in _blocks(lo, hi, first, end, STAGES, own):
            rows = dsl.load(idx[b, n * BN], (BN,), other=-1)  # slots past L are dead like -1
            if length is not None:  # and those past the query's own length
                rows = dsl.where(n * BN + dsl.arange(BN) < length, rows, -1)
            # a dead slot reads a zero row
            got = gather(rows) if gather else dsl.load(kv[b, rows, 0], (BN, D), role="operand")
            parts = [g if isinstance(g, tuple) else (g,) for g in (got if columns else [got])]
            scores = dsl.zeros((H, BN), dsl.f32, role="accumulator")
            for q_tile, tiles in zip(q_tiles, parts):
                for t in tiles:
                    dsl.gemm(q_tile, t, scores, transpose_b=True)
            live = (rows >= 0) & (rows < live_below)
            masked = dsl.where(live[None, :], scores * scale, NEG_INF)
            new_max = dsl.maximum(row_max, masked.max(axis=1))
            base = dsl.where(new_max > NEG_INF, new_max, 0.0)  # no live slot yet: weights 0, not NaN
            p = dsl.exp2(masked - base[:, None])
            rescale = dsl.exp2(row_max - base)
            row_sum[:] = row_sum * rescale + p.sum(axis=1)
            for acc in accs:
                acc[:] = acc * rescale[:, None]
            row_max[:] = new_max
            # P in two BF16 parts, the small one first: P V to about 2^-16 of |P| |V| (the rows are
            # BF16 values), where one BF16 rounding of P left 2^-9, which moved the tiny models'
            # logits by 0.3 against the FP32 reference; the second MMA is cheap beside the rows' loads
            for part in reversed(bf16_parts(p, 2)):
                for acc, tiles in zip(accs, parts):
                    for t in tiles:
                        dsl.gemm(part, t, acc)
    return accs, row_max, row_sum


def _blocks(lo, hi, first, end, STAGES, own):
    """The slot blocks ``_attend`` runs of one segment of the list (blocks ``first`` .. ``end``):
    (block index, the query's length or None) for blocks ``lo`` .. ``hi`` in it, or, with ``own``,
    for the query's own range read from data (a loop that ends where the data says, its blocks at a
    data offset)."""
    if own is None:
        start = lo if first == 0 else dsl.maximum(lo, first)
        stop = hi if end is None else dsl.minimum(hi, end)
        for n in dsl.pipelined(stop, stages=STAGES, start=start):
            yield n, None
        return
    own_lo, own_hi, length, most = own
    seg_lo = own_lo if first == 0 else dsl.maximum(own_lo, first)
    seg_hi = own_hi if end is None else dsl.minimum(own_hi, end)
    base = dsl.scalar(seg_lo)
    for i in dsl.pipelined(most, stages=STAGES, stop=dsl.maximum(seg_hi - seg_lo, 0)):
        yield base + i, length


def own_ranges(idx, lens, b, s, SPLIT, BN):
    """Query b's range s of ``SPLIT`` when its list counts ``lens[b]`` slots (at most L): ``_attend``'s
    ``own``: (first block, end block, the query's length: slots at and past it are dead), one-element
    i32 tiles, and the most blocks a range holds. The ranges cut the query's own blocks, not the list
    tensor's L, so a query's bits do not depend on how far a batch pads its list (a V4 HCA layer's
    lists differ in length by sequence, and a step pads them to the longest)."""
    length = dsl.minimum(dsl.load(lens[b], (1,)), idx.L)
    blocks = (length + (BN - 1)) // BN
    return s * blocks // SPLIT, (s + 1) * blocks // SPLIT, length, dsl.cdiv(dsl.cdiv(idx.L, BN), SPLIT)


def finish(q, sink, o, lse, b, accs, row_max, row_sum, columns=None, epilogue=None):
    """Query b's output and LSE from its online softmax (``_attend``'s accumulators, one a column
    group), with the sink's ``2^(sink log2 e - top)`` in the denominator (padded head rows get a
    sink of 0 and are never stored). With an ``epilogue`` the rope channels' output goes to its
    workspace as well, which ``rope_phase`` rotates into ``o``."""
    sink2 = dsl.load(sink[0], (_head_rows(q),)) * LOG2E
    top = dsl.maximum(row_max, sink2)
    base = dsl.where(top > NEG_INF, top, 0.0)
    w = dsl.exp2(row_max - base)
    total = row_sum * w + dsl.exp2(sink2 - base)
    for (first, width), acc in zip(columns or ((0, q.D),), accs):
        y = (acc * (w / total)[:, None]).to(dsl.bf16)
        dsl.store(o[b, 0, first], y)
        if epilogue is not None:
            epilogue.keep(b, first, width, y)
    if lse is not None:
        dsl.store(lse[b, 0], (base + dsl.log2(total)) * LN2)


# SPLIT defaults to 16, the two-phase form, for the tuning cache key (see gemm_splitk.py)
@dsl.kernel(batch_dim="B", dynamic=("B", "L", "N", "P", "QR"))
def sparse_mqa_decode(q: dsl.Tensor["B", "H", "D", dsl.bf16], kv: dsl.Tensor["B", "N", "D", dsl.bf16],
                      idx: dsl.Tensor["B", "L", dsl.i32], sink: dsl.Tensor["H", dsl.f32],
                      o: dsl.Tensor["B", "H", "D", dsl.bf16],
                      lse: dsl.OptionalTensor["B", "H", dsl.f32] = None,
                      positions: dsl.OptionalTensor["B", dsl.i32] = None,
                      cos: dsl.OptionalTensor["P", "HALF", dsl.f32] = None,
                      sin: dsl.OptionalTensor["P", "HALF", dsl.f32] = None,
                      o_q: dsl.OptionalTensor["QR", "D", dsl.f8e4m3] = None,
                      o_qs: dsl.OptionalTensor["QR", "QD", dsl.u8] = None,
                      lens: dsl.OptionalTensor["B", dsl.i32] = None, *,
                      GROUPS: dsl.Const = 8, QBLOCK: dsl.Const = 128,
                      BN: dsl.Tunable = dsl.choice(64, 32, 128),
                      STAGES: dsl.Tunable = dsl.int_range(1, 3, default=1),
                      SPLIT: dsl.Tunable = dsl.choice(16, 1, 2, 4, 8, 32),
                      BD: dsl.Tunable = dsl.choice(128, 64, 256),
                      DG: dsl.Tunable = dsl.choice(1, 2, 4, 8)):
    epilogue = epilogue_of("sparse_mqa_decode", q, positions, cos, sin)
    columns = column_groups(q.D, DG)
    rows_of = None if columns is None else (lambda b: lambda rows: [
        dsl.load(kv[b, rows, first], (BN, width), role="operand") for first, width in columns])
    decode(q, kv, idx, sink, o, lse, BN, STAGES, SPLIT, BD, rows_of=rows_of, columns=columns, epilogue=epilogue,
           fp8_out=fp8_out_of("sparse_mqa_decode", q, o_q, o_qs, GROUPS, QBLOCK), lens=lens)


def decode(q, kv, idx, sink, o, lse, BN, STAGES, SPLIT, BD, rows_of=None, rows_total=None, columns=None,
           epilogue=None, fp8_out=None, lens=None):
    """The kernel's body (the module docstring); ``rows_of(b)``, where given, is the ``kv_rows``
    gather of ``_attend`` for query b, over ``rows_total`` cache rows (a cache of other row
    formats, ``sparse_mqa_decode_fp8``), split by ``columns`` where given (``_attend``). With an
    ``epilogue`` (``decode_epilogue.Epilogue``) the stored output's rope channels are rotated by -P;
    with ``fp8_out`` (``decode_fp8_out.Fp8Out``) the output is also written as wo_a's FP8 input,
    the combine's column blocks then its blocks. With ``lens`` each query's list counts its own
    length of slots (``own_ranges``)."""
    H, D = q.H, q.D
    blocks = dsl.cdiv(idx.L, BN)
    rows_for = rows_of or (lambda b: None)

    def own(b, s):
        return None if lens is None else own_ranges(idx, lens, b, s, SPLIT, BN)

    if SPLIT == 1:
        if epilogue is not None:
            epilogue.one_phase()
        for b in dsl.grid(q.B):
            attended = _attend(q, kv, idx, b, 0, blocks, BN, STAGES, rows_for(b), rows_total, columns, own(b, 0))
            finish(q, sink, o, lse, b, *attended, columns, epilogue)
        if epilogue is not None:
            rope_phase(q, o, epilogue)
        if fp8_out is not None:
            quant_phase(q, o, fp8_out)
        return
    BD = BD if fp8_out is None else fp8_out.block
    part_o = dsl.workspace("part_o", (SPLIT, q.B, H, D), dsl.f32)
    part_lse = dsl.workspace("part_lse", (SPLIT, q.B, H), dsl.f32)
    for b, s in dsl.grid(q.B, SPLIT):
        accs, row_max, row_sum = _attend(q, kv, idx, b, s * blocks // SPLIT, (s + 1) * blocks // SPLIT, BN,
                                         STAGES, rows_for(b), rows_total, columns, own(b, s))
        seen = row_sum > 0.0  # false for a range without live slots
        inv = dsl.where(seen, 1.0 / row_sum, 0.0)
        for (first, _), acc in zip(columns or ((0, D),), accs):
            dsl.store(part_o[s, b, 0, first], acc * inv[:, None])
        dsl.store(part_lse[s, b, 0], dsl.where(seen, row_max + dsl.log2(row_sum), NEG_INF))
    for b, j in dsl.grid(q.B, dsl.cdiv(D, BD)):  # BD output columns a block
        sink2 = dsl.load(sink[0], (H,)) * LOG2E
        top = dsl.full((H,), NEG_INF, dsl.f32)
        top[:] = sink2
        for s in dsl.range(SPLIT):
            top[:] = dsl.maximum(top, dsl.load(part_lse[s, b, 0], (H,)))
        base = dsl.where(top > NEG_INF, top, 0.0)
        total = dsl.zeros((H,), dsl.f32)
        total[:] = dsl.exp2(sink2 - base)
        out = dsl.zeros((H, BD), dsl.f32)
        if epilogue is not None:  # the partners' output, added up alike (a nope column's reads nothing)
            cols = j * BD + dsl.arange(BD)
            mates, mate = epilogue.partner(cols), dsl.zeros((H, BD), dsl.f32)
        for s in dsl.range(SPLIT):  # in range order: the same sum at every batch size
            w = dsl.exp2(dsl.load(part_lse[s, b, 0], (H,)) - base)
            total[:] = total + w
            out[:] = out + dsl.load(part_o[s, b, 0, j * BD], (H, BD)) * w[:, None]
            if epilogue is not None:
                mate[:] = mate + dsl.load(part_o[s, b, 0, mates], (H, BD)) * w[:, None]
        y = (out * (1.0 / total)[:, None]).to(dsl.bf16)
        if epilogue is not None:
            y = epilogue.rotated(b, cols, y, (mate * (1.0 / total)[:, None]).to(dsl.bf16))
        dsl.store(o[b, 0, j * BD], y)
        if fp8_out is not None:
            fp8_out.store(b, j, y)
        if lse is not None:  # every column block writes the same bits
            dsl.store(lse[b, 0], (base + dsl.log2(total)) * LN2)


def _rows(kv, idx):
    """The gathered rows (B, L, D) in float64 and which slots are live (B, L)."""
    live = (idx >= 0) & (idx < kv.shape[1])
    safe = torch.where(live, idx, torch.zeros_like(idx)).long()
    rows = torch.gather(kv, 1, safe[:, :, None].expand(-1, -1, kv.shape[2])).double()  # gather, then widen
    return rows, live


def _probabilities(q, kv, idx, sink):
    """Each slot's softmax weight (B, H, L), the live rows, the log of the denominator (B, H) and
    the scaled logits, in float64."""
    rows, live = _rows(kv, idx)
    logits = torch.einsum("bhd,bld->bhl", q.double(), rows) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~live[:, None, :], float("-inf"))
    s = sink.double()[None, :]
    mx = torch.maximum(logits.amax(-1), s)  # the sink in the max too: no overflow from a large sink
    e = torch.exp(logits - mx[..., None])
    den = e.sum(-1) + torch.exp(s - mx)
    return e / den[..., None], rows, mx + torch.log(den), logits


def own_list(idx: torch.Tensor, lens: torch.Tensor | None) -> torch.Tensor:
    """``idx`` with each query's slots at and past its ``lens`` dead (-1); ``idx`` without ``lens``."""
    if lens is None:
        return idx
    cols = torch.arange(idx.shape[-1], device=idx.device)
    return torch.where(cols[None, :] < lens.to(idx.device).long()[:, None], idx, torch.full_like(idx, -1))


def sparse_mqa_decode_reference(q, kv, idx, sink, positions=None, cos=None, sin=None, GROUPS=None,
                                QBLOCK=None, lens=None) -> dict:
    """model.md 2.5.6: one softmax over the live slots plus the value-less sink logit; with
    ``positions``, the output's rope channels rotated by -P (``inverse_rope``). ``GROUPS`` /
    ``QBLOCK`` shape the FP8 output, a function of the kernel's own ``o`` (``Spec.derived``). With
    ``lens``, a query's slots at and past its length are dead."""
    p, rows, lse, _ = _probabilities(q, kv, own_list(idx, lens), sink)
    o = torch.einsum("bhl,bld->bhd", p, rows).to(torch.bfloat16)
    if positions is not None:
        o = inverse_rope(o, positions, cos, sin)
    return {"o": o, "lse": lse.float()}


def _error_bound(case, output, inputs):
    idx = own_list(inputs["idx"], inputs.get("lens"))
    p, rows, _, logits = _probabilities(inputs["q"], inputs["kv"], idx, inputs["sink"])
    if output == "o":
        size = torch.einsum("bhl,bld->bhd", p, rows.abs())  # A_c = sum_j p_j |v_jc| >= |o_c|
        if inputs.get("positions") is not None:
            return rotated_bound(size, inputs).float()
        return 2.0 ** -8 * size.float()
    d = inputs["q"].shape[-1]
    mag = torch.einsum("bhd,bld->bhl", inputs["q"].double().abs(), rows.abs()) / math.sqrt(d)
    live = torch.isfinite(logits)
    worst = torch.where(live, mag, torch.zeros_like(mag)).amax(-1) if mag.shape[-1] else mag.sum(-1)
    return (2 * (d + 4) * 2.0 ** -24 * worst).float()


def _tolerance(case, output):
    return (1e-6, 2.0 ** -8) if output == "o" else (1e-5, 2.0 ** -20)


def _index_list(case, g):
    """The index list (B, L): each sequence's first ``count`` slots name rows (with repeats
    where asked), the rest -1; ``holes`` is the share of -1 among the named slots."""
    b, n, length = case["B"], case["N"], case["L"]
    idx = torch.randint(0, n, (b, length), generator=g, dtype=torch.int32)
    valid = case.get("valid", "ragged")
    if valid == "ragged":  # a count per sequence, from none to the whole list
        counts = torch.randint(0, length + 1, (b,), generator=g)
        counts[0] = length
    elif valid == "one":  # all but one slot dead
        counts = torch.ones(b, dtype=torch.long)
    elif valid == "none":
        counts = torch.zeros(b, dtype=torch.long)
    else:
        counts = torch.full((b,), length)
    slots = torch.arange(length)[None, :]
    holes = torch.rand(b, length, generator=g) < case.get("holes", 0.0)
    if valid == "one":  # the live slot anywhere in the list, not only first
        where = torch.randint(0, max(length, 1), (b, 1), generator=g)
        dead = slots != where
    else:
        dead = (slots >= counts[:, None]) | holes
    if case.get("repeat") and length >= 2:  # the first live rows listed again further on
        idx[:, length // 2:] = idx[:, :length - length // 2].clone()
    idx[dead] = -1
    if case.get("out_of_range") and length >= 3:
        idx[:, 2] = n  # past the cache: dead like -1
    return idx


def random_inputs(case, device, seed, q_shape, kv_shape):
    """Random q (``q_shape``: queries x H x D), rows ``kv`` (``kv_shape``), sink, the index list of
    ``case["B"]`` queries and NaN-filled outputs; model-sized rows (up to GBs) are drawn where they
    live, the index list on the CPU."""
    h, length = case["H"], case["L"]
    if device.type == "meta":  # shapes and dtypes only
        return {"q": torch.empty(q_shape, dtype=torch.bfloat16), "kv": torch.empty(kv_shape, dtype=torch.bfloat16),
                "idx": torch.empty(q_shape[0], length, dtype=torch.int32), "sink": torch.empty(h),
                "o": torch.empty(q_shape, dtype=torch.bfloat16), "lse": torch.empty(q_shape[:2]),
                **epilogue_inputs(case, device, seed), **fp8_out_inputs(case, device), **_lens(case, device)}
    g = torch.Generator(device=device).manual_seed(seed)
    spread = case.get("spread", 1.0)  # scales q: a spread of 30 makes scores ~30 apart
    q = (torch.randn(q_shape, generator=g, device=device) * spread).to(torch.bfloat16)
    kv = torch.randn(kv_shape, generator=g, device=device).to(torch.bfloat16)
    sink = torch.randn(h, generator=g, device=device) * case.get("sink", 1.0)
    idx = _index_list(case, torch.Generator().manual_seed(seed + 1))
    return {"q": q, "kv": kv, "idx": idx.to(device), "sink": sink,
            "o": torch.full(q_shape, float("nan"), dtype=torch.bfloat16, device=device),
            "lse": torch.full(q_shape[:2], float("nan"), dtype=torch.float32, device=device),
            **epilogue_inputs(case, device, seed), **fp8_out_inputs(case, device), **_lens(case, device, seed)}


def _lens(case, device, seed=0) -> dict:
    """With ``case["lens"]``, each query's own list length (``lens``): 0, L, past L and lengths
    in between, so some queries' lists end inside a slot block and some are empty; ``"full"``
    (the model shapes: every query at the shape's L, what a benchmark times), L for each."""
    if not case.get("lens"):
        return {}
    b, length = case["B"], case["L"]
    if device.type == "meta":
        return {"lens": torch.empty(b, dtype=torch.int32)}
    if case["lens"] == "full":
        return {"lens": torch.full((b,), length, dtype=torch.int32, device=device)}
    g = torch.Generator().manual_seed(seed + 2)
    lens = torch.randint(0, length + 1, (b,), generator=g)
    lens[: min(b, 3)] = torch.tensor([0, length, length + 7])[: min(b, 3)]
    return {"lens": lens.to(torch.int32).to(device)}


def _inputs(case, device, seed):
    b, h, d = case["B"], case["H"], case["D"]
    return random_inputs(case, device, seed, (b, h, d), (b, case["N"], d))


def layer_kinds(m) -> dict[str, tuple[int, int]]:
    """Per compressed layer kind of model ``m``: the list length L (window + top-k; V4 HCA's window
    + every visible row at 1M) and a decode step's cache rows N. An SWA layer's list (the window
    alone) is the same build at a shorter L; V4.1's ratio-1 layers read layer 20's rows, the same
    list length as ratio 2."""
    kinds = {}
    for ratio in m.compress_ratios:
        if ratio == 128:
            rows = m.window + shapes.CONTEXT // ratio
            kinds[f"hca{rows}"] = (rows, rows)
        elif not (m.compress_ratios == (2, 1) and ratio == 1):
            kinds[f"csa_r{ratio}_topk{m.window + m.index_topk}"] = (m.window + m.index_topk,
                                                                     m.window + (1 << 16) // ratio)
    return kinds


def _model_shapes(m) -> dict:
    """Per compressed layer kind (``layer_kinds``) at decode batches 1, 16 and 64."""
    return {f"{m.short}/{kind}/decode{b}": {"B": b, "H": m.heads, "D": m.head_dim, "L": length, "N": n,
                                            "model": m.name}
            for kind, (length, n) in layer_kinds(m).items() for b in shapes.DECODE_SAMPLE}


SMALL = {"BN": 32, "STAGES": 1}  # small slot blocks: several ranges even at a few hundred slots
EPILOGUE_CASES = {
    "rope_split4": {"B": 3, "H": 64, "D": 128, "N": 300, "L": 200, "holes": 0.3, "rope": "random",
                    "config": {**SMALL, "SPLIT": 4, "BD": 64}},
    "rope_split2_mixed_block": {"B": 3, "H": 4, "D": 192, "N": 80, "L": 90, "rope": "wrap", "P": 1000,
                                "config": {**SMALL, "SPLIT": 2, "BD": 128}},
    "rope_past_table": {"B": 4, "H": 64, "D": 128, "N": 60, "L": 64, "rope": "past", "P": 70,
                        "config": {**SMALL, "SPLIT": 3}},
    "rope_one_phase": {"B": 3, "H": 64, "D": 128, "N": 90, "L": 96, "rope": "zero", "config": {**SMALL, "SPLIT": 1}},
    "rope_one_phase_few_heads": {"B": 3, "H": 4, "D": 64, "N": 40, "L": 50, "rope": "wrap", "P": 600,
                                 "base": 160000.0, "config": {**SMALL, "SPLIT": 1}},
    "rope_all_dead": {"B": 2, "H": 64, "D": 64, "N": 50, "L": 70, "valid": "none", "rope": "random",
                      "config": {**SMALL, "SPLIT": 2}},
    # 32 rope channels (tables of 16 columns)
    "rope_r32": {"B": 2, "H": 64, "D": 96, "N": 70, "L": 64, "rope": "random", "ROPE": 32,
                 "config": {**SMALL, "SPLIT": 2, "BD": 64}},
}
# wo_a's FP8 input (``decode_fp8_out``): in the combine (its column blocks then the FP8 blocks, one
# straddling nope and rope channels) and in the one-phase form's own phase; 8 groups of 8 heads, 2 of 2
FP8_OUT_CASES = {
    "fp8_out_split3": {"B": 3, "H": 64, "D": 128, "N": 200, "L": 150, "holes": 0.3, "GROUPS": 8, "QBLOCK": 32,
                       "config": {**SMALL, "SPLIT": 3}},
    "fp8_out_rope_straddle": {"B": 2, "H": 64, "D": 256, "N": 90, "L": 100, "rope": "random", "GROUPS": 8,
                              "QBLOCK": 128, "config": {**SMALL, "SPLIT": 2}},
    "fp8_out_one_phase_rope": {"B": 3, "H": 4, "D": 128, "N": 60, "L": 70, "rope": "wrap", "P": 600, "GROUPS": 2,
                               "QBLOCK": 32, "config": {**SMALL, "SPLIT": 1}},
    "fp8_out_all_dead": {"B": 2, "H": 64, "D": 64, "N": 50, "L": 70, "valid": "none", "GROUPS": 8, "QBLOCK": 32,
                         "config": {**SMALL, "SPLIT": 2}},
}
SPEC = register(Spec(
    kernel=sparse_mqa_decode,
    reference=sparse_mqa_decode_reference,
    make_inputs=_inputs,
    outputs=("o", "lse"),
    cases={
        "split4_holes": {"B": 3, "H": 64, "D": 64, "N": 300, "L": 200, "holes": 0.3,
                         "config": {**SMALL, "SPLIT": 4}},
        "one_phase_ragged": {"B": 4, "H": 64, "D": 64, "N": 90, "L": 96, "config": {**SMALL, "SPLIT": 1}},
        # a small model's 4 heads: padded to MIN_HEAD_ROWS with zero queries, never stored
        "few_heads": {"B": 3, "H": 4, "D": 64, "N": 60, "L": 70, "holes": 0.3, "config": {**SMALL, "SPLIT": 2}},
        "few_heads_one_phase": {"B": 2, "H": 4, "D": 64, "N": 40, "L": 50, "config": {**SMALL, "SPLIT": 1}},
        "all_but_one": {"B": 3, "H": 64, "D": 64, "N": 50, "L": 100, "valid": "one",
                        "config": {**SMALL, "SPLIT": 4}},
        "all_dead": {"B": 2, "H": 64, "D": 64, "N": 50, "L": 70, "valid": "none", "config": {**SMALL, "SPLIT": 2}},
        "all_dead_one_phase": {"B": 2, "H": 64, "D": 64, "N": 50, "L": 40, "valid": "none",
                               "config": {**SMALL, "SPLIT": 1}},
        "repeats": {"B": 2, "H": 64, "D": 64, "N": 20, "L": 128, "valid": "all", "repeat": True,
                    "out_of_range": True, "config": {**SMALL, "SPLIT": 2}},
        # scores ~30 apart and sinks ~20 apart: nearly one-hot weights, the sink often dominant
        "spread": {"B": 2, "H": 64, "D": 64, "N": 200, "L": 160, "spread": 30.0, "sink": 20.0,
                   "holes": 0.5, "config": {**SMALL, "SPLIT": 8}},
        # 3 slot blocks over 8 ranges: empty ranges among full ones
        "empty_ranges": {"B": 2, "H": 64, "D": 64, "N": 100, "L": 80, "holes": 0.2,
                         "config": {**SMALL, "SPLIT": 8}},
        # the inverse rope epilogue (``decode_epilogue.Epilogue``): the combine's column blocks of nope channels, of
        # rope channels and of both; the one-phase form's own phase; positions 0, past the table
        # (zeros), around the ring's and the table blocks' boundaries
        **EPILOGUE_CASES,
        **FP8_OUT_CASES,
        # the output's columns in DG groups (column_groups), each its own accumulator: split and
        # one-phase forms, with the epilogue (rope channels across two groups) and wo_a's FP8 input
        "groups4_holes": {"B": 3, "H": 64, "D": 128, "N": 200, "L": 150, "holes": 0.3,
                          "config": {**SMALL, "SPLIT": 2, "DG": 4}},
        "groups2_rope_one_phase": {"B": 2, "H": 64, "D": 128, "N": 90, "L": 96, "rope": "random",
                                   "config": {**SMALL, "SPLIT": 1, "DG": 2}},
        "groups4_fp8_out_rope_one_phase": {"B": 3, "H": 4, "D": 128, "N": 60, "L": 70, "rope": "wrap", "P": 600,
                                           "GROUPS": 2, "QBLOCK": 32, "config": {**SMALL, "SPLIT": 1, "DG": 4}},
        # each query's own list length (lens): 0, L, past L, in between; the ranges cut it, not L
        "lens_split3": {"B": 5, "H": 64, "D": 64, "N": 200, "L": 150, "holes": 0.2, "lens": True,
                        "config": {**SMALL, "SPLIT": 3}},
        "lens_one_phase_rope": {"B": 4, "H": 64, "D": 128, "N": 90, "L": 96, "lens": True, "rope": "random",
                                "config": {**SMALL, "SPLIT": 1}},
    },
    build_cases={"v4_csa": {"B": 16, "H": 64, "D": 512, "L": 640, "N": 16512},
                 "v4_hca_1m": {"B": 4, "H": 64, "D": 512, "L": 8320, "N": 8320}},
    tolerance=_tolerance,
    extra_error=_error_bound,
    derived=DERIVED,
    constants_of=fp8_out_constants,
    flops=lambda c: 4.0 * c["B"] * c["H"] * c["L"] * c["D"],
    bytes_moved=lambda c: 2.0 * c["B"] * (c["L"] * c["D"] + 2 * c["H"] * c["D"]) + 4.0 * c["B"] * c["L"],
    model_shapes=shapes.for_models(_model_shapes),
    # index lists from one slot to several hundred blocks, caches from one row up
    sweep={"B": Dim(1, 4, large=64), "H": OneOf(64, 64, 4), "D": OneOf(64, 128), "L": Dim(1, 260, large=9000),
           "N": Dim(1, 300, large=300000), "holes": OneOf(0.0, 0.3, 0.9), "repeat": OneOf(False, True),
           "valid": OneOf("ragged", "all", "one"), "spread": OneOf(1.0, 10.0), "sink": OneOf(1.0, 10.0),
           "config": {"SPLIT": OneOf(1, 2, 4, 8, 16), "BN": OneOf(32, 64), "DG": OneOf(1, 1, 2)}},
))
