"""A step's window and compressed rows: read for its queries, attended over, written back.

The window rows a chunk's queries see (``window_rows``), the compressed rows they read
(``Selected``, ``Visible``), one attention over them for a step's sequences (``attend``: the rows
gathered once a sequence for a prefill chunk, ``sparse_attention_rows``; a decode step over rings as
stored read where the rows are, ``sparse_attention_stored``), and the rows' way into the cache: a
step's window rows normed, rotated and rounded to the rings' format (``window_kv``), written by
``kv_insert`` at decode or as ``kv_encode``'s bytes (``write_ring``). The row formats are
``runtime/stored.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import ship
from ..model_ops import model_op
from ..stored import FP8_BLOCK, NOPE_BLOCK, NOPE_ROPE, PackedRows, StoredRing, decode_rows
from .common import Ctx, Rotary, attention_with_sink, pad_cat, rms_norm, rope, round_rows, sparse_attention
from .step import one_token_each

# kv_encode's scale floor for FP8 rows: the quantize kernel's least, so that the only blocks it
# moves are those whose amax is below 2^-118 (rows the kv_round trip, with no floor, left finer)
KV_ENCODE_FLOOR = 2.0**-118


def window_rows(ring, start: int, new_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's window rows, each once: [W - 1 + S, d] (positions start - W + 1 .. start + S - 1,
    the ring's rows of positions < start first), and each query's W of them [S, W] as row indices
    in position order, -1 before position 0.

    `ring` [W, d] holds the rows of positions < start at slot `pos % W`; new_rows [S, d] are the chunk's.
    """
    size = ring.shape[0]
    prev_pos = torch.arange(start - size + 1, start)
    prev = ring[ship(prev_pos % size, ring.device)].to(new_rows.dtype)
    s = new_rows.shape[0]
    at = torch.arange(s)[:, None] + torch.arange(size)[None, :]  # query i's slot j: row i + j
    pos = at + start - size + 1
    return torch.cat([prev, new_rows], 0), ship(torch.where(pos >= 0, at, -1), ring.device)


@dataclass
class Selected:
    """Each query's selected rows of its sequence's compressed store: ``sel[i]`` [S_i, K] row
    indices into ``stores[i]`` (`cache.Rows`), -1 for none."""

    stores: list
    sel: list[torch.Tensor]

    def rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's stored rows [n, d] and each query's indices into them [S_i, K] (-1 none)."""
        return self.stores[i].view, self.sel[i]

    def index(self, i: int) -> torch.Tensor:
        """Each query's indices into sequence i's rows [S_i, K] (-1 none), the rows left as stored."""
        return self.sel[i]


@dataclass
class Visible:
    """Every row of its sequence's store a query can see: the first ``n_visible[i]`` [S_i] (host)."""

    stores: list
    n_visible: list[torch.Tensor]

    def rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stores[i].view, self.index(i)

    def index(self, i: int) -> torch.Tensor:
        visible = self.n_visible[i]
        at = torch.arange(self.stores[i].n)[None, :].expand(len(visible), -1)
        return torch.where(at < visible[:, None], at, -1)


def attend(ctx: Ctx, seqs: list, layer: int, q: torch.Tensor, kv: torch.Tensor, compressed, sink: torch.Tensor,
           scale: float, encoded: torch.Tensor | None, rotary: Rotary, positions: torch.Tensor) -> torch.Tensor:
    """A layer's sparse attention for a step's sequences (``(StepSeq, slice)`` pairs) as ``wo_a``
    takes it: the output's rope channels rotated by -P (``rotary`` at the queries' ``positions``,
    model.md 2.5.6), in the activation dtype. Each query's window rows, then its compressed rows
    (``Selected`` or ``Visible``; None: a window-only layer); each sequence's ring written after its
    rows were read. A prefill chunk's queries read their rows gathered once a sequence and rotate in
    the same op (``sparse_attention_rows``); a decode step over rings as stored (``stored.py``;
    ``encoded`` is then ``kv``'s bytes, ``kv_encode``) reads them where they are and rotates in the
    same op too (``sparse_attention_stored``); a decode step over rings of values gathers every
    sequence's rows at once (``sparse_attention``), then the ``rope`` op."""
    ring0 = seqs[0][0].cache.layers[layer].ring
    if one_token_each(seqs) and isinstance(ring0, StoredRing):
        return ctx.act(_stored_decode(ctx, seqs, layer, q, encoded, compressed, sink, scale, rotary, positions))
    if one_token_each(seqs) and ring0.dtype == kv.dtype:  # a decode step's rows gathered at once
        keys, valid = _decode_keys(seqs, layer, kv, compressed)
        return _inverse_rope(ctx, rotary, positions, sparse_attention(ctx, q, keys, valid, sink, scale))
    rows, idx, cmp, fmt = _chunk_rows(seqs, layer, kv, compressed, encoded)
    return ctx.act(sparse_attention_rows(ctx, q, rows, idx, sink, scale, rotary, positions, cmp, ring0.shape[0], fmt))


def _inverse_rope(ctx: Ctx, rotary: Rotary, positions: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The attention output ``out`` in the activation dtype, its rope channels rotated by -P (the
    ``rope`` op), in the activation dtype again."""
    return ctx.act(rope(ctx, rotary, ctx.act(out), positions, inverse=True))


def _chunk_rows(seqs: list, layer: int, kv: torch.Tensor, compressed, encoded):
    """(rows, index lists, cmp, format): the rows a step's queries read and each query's index list
    into them (-1 none): each sequence's window rows once, then its compressed rows, as values in
    one stack, or, where the compressed rows are stored (V4.1's ``nvfp4``, V4's ``fp8_nope``:
    ``stored.py``), their bytes in a second stack (``cmp``; None otherwise) that the lists' slots
    past the window's W name. Each sequence's ring is written after its rows were read."""
    fmt = _stored_format(compressed)
    rows, idx, cmp, base, cbase = [], [], [], 0, 0
    for i, (seq, sl) in enumerate(seqs):
        ring = seq.cache.layers[layer].ring
        r, ix = window_rows(ring, seq.start, kv[sl])
        ix = torch.where(ix >= 0, ix + base, -1)
        if compressed is not None:
            sel = ship(compressed.index(i), ix.device)
            if fmt:  # the bytes as stored, each sequence's after the last's
                cmp.append(compressed.stores[i].stored)
                ix = torch.cat([ix, torch.where(sel >= 0, sel + cbase, -1)], 1)
                cbase += cmp[-1].shape[0]
            else:
                ix = torch.cat([ix, torch.where(sel >= 0, sel + base + r.shape[0], -1)], 1)
                r = torch.cat([r, compressed.stores[i].view.to(r.dtype)])
        rows.append(r)
        idx.append(ix)
        base += r.shape[0]
        # its window rows above are a copy
        write_ring(ring, seq.start, kv[sl], None if encoded is None else encoded[sl])
    # no stored row yet: every compressed slot is -1, and no second stack is needed
    return torch.cat(rows), pad_cat(idx, -1), (torch.cat(cmp) if fmt and cbase else None), fmt


def _stored_format(compressed) -> str | None:
    """The format the compressed rows are stored in where the prefill kernel reads them as they are
    (V4.1's ``nvfp4``, V4's ``fp8_nope``), else None (rows kept as values)."""
    if compressed is None:
        return None
    fmts = {st.fmt if isinstance(st, PackedRows) else None for st in compressed.stores}
    fmt = fmts.pop() if len(fmts) == 1 else None
    return fmt if fmt in ("nvfp4", "fp8_nope") else None


@model_op("sparse_attention_rows")
def sparse_attention_rows(ctx: Ctx, q: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                          scale: float, rotary: Rotary | None = None, positions: torch.Tensor | None = None,
                          cmp: torch.Tensor | None = None, window: int | None = None,
                          fmt: str | None = None) -> torch.Tensor:
    """``sparse_attention`` of a chunk's queries [T, H, d] over rows they share: ``rows`` [N, d]
    (each sequence's window rows once, then its compressed rows), ``idx`` [T, L] each query's own
    (-1 none). With ``cmp`` [NC, row bytes] u8, the compressed rows as stored in format ``fmt``
    (V4.1's ``nvfp4``, V4's ``fp8_nope``): a list's first ``window`` slots name ``rows`` and the
    rest ``cmp``'s rows. With ``rotary``,
    the output in the activation dtype rotated by -P at the queries' ``positions`` (host [T]) as the
    ``rope`` op does (what ``wo_a`` takes). FP32 out."""
    if cmp is not None:
        far = (torch.arange(idx.shape[1], device=idx.device) >= window)[None, :] & (idx >= 0)
        idx = torch.where(far, idx + rows.shape[0], idx)
        rows = torch.cat([rows, decode_rows(cmp, q.shape[-1], fmt).to(rows.dtype)])
    out = attention_with_sink(ctx.ops, q, rows[idx.clamp(min=0)], idx >= 0, sink, scale)
    return out if rotary is None else rotary.apply(ctx.act(out), positions, inverse=True)


def _stored_decode(ctx: Ctx, seqs: list, layer: int, q: torch.Tensor, encoded: torch.Tensor, compressed, sink,
                   scale, rotary: Rotary, positions: torch.Tensor):
    """``attend`` of a decode step over rings as stored: the rings' rows as one stack, the new
    rows' bytes written first (slot P mod W), and one index list a query: its W window slots in
    position order (-1 before position 0), then its compressed rows (``Selected``: its selected
    ones; ``Visible``: every row it sees; -1 for none); the output rotated by -P in the op.
    ``positions`` (host): the step's, one a sequence (each its token's)."""
    from ...kernels_spec.sparse_mqa_decode_fp8 import ring_slots
    from ..stacked import stack_attr

    rings = [seq.cache.layers[layer].ring for seq, _ in seqs]
    ring = stack_attr(rings, "rows")
    b, size, dev = ring.shape[0], ring.shape[1], ring.device
    pos = ship(positions, dev)
    each = torch.arange(b, device=dev)
    if encoded is not None:  # (kv_insert wrote them already)
        ring[each, pos % size] = encoded
    window = pos[:, None] - size + 1 + torch.arange(size, device=dev)[None, :]  # positions P - W + 1 .. P
    idx = torch.where(window >= 0, window % size, -1)
    cmp = lens = None
    if compressed is not None:  # the list's ring part is ring_slots(W) slots: -1 past the window's W
        cmp = stack_attr(compressed.stores, "rows")
        pad = idx.new_full((b, ring_slots(size) - size), -1)
        idx = torch.cat([idx, pad, ship(_compressed_slots(compressed), dev)], 1)
        if not isinstance(compressed, Selected):  # an HCA list: each its own length (docs/attention_path.md)
            lens = ring_slots(size) + torch.cat(compressed.n_visible).to(torch.int32)
    return sparse_attention_stored(ctx, q, ring, idx.to(torch.int32), cmp, sink, scale, rings[0].fmt, rotary, positions,
                                   lens)


def _compressed_slots(compressed) -> torch.Tensor:
    """A decode step's compressed rows a query reads, [B, K] (-1 none): its selected rows
    (``Selected``) or every row it sees (``Visible``: rows 0 .. n_visible - 1)."""
    if isinstance(compressed, Selected):
        return torch.cat(compressed.sel)
    n = max(s.n for s in compressed.stores)
    rows = torch.arange(n)[None, :]
    return torch.where(rows < torch.cat(compressed.n_visible)[:, None], rows, -1)


@model_op("sparse_attention_stored")
def sparse_attention_stored(ctx: Ctx, q: torch.Tensor, ring: torch.Tensor, idx: torch.Tensor,
                            cmp: torch.Tensor | None, sink: torch.Tensor, scale: float,
                            fmt: str = "fp8/32", rotary: Rotary | None = None,
                            positions: torch.Tensor | None = None, lens: torch.Tensor | None = None) -> torch.Tensor:
    """``sparse_attention`` of one query a sequence over its rows as stored: ``ring`` [B, W, row
    bytes] u8 in format ``fmt`` (``stored.py``: V4.1's ``fp8/32``, V4's ``fp8_nope``), ``cmp``
    [B, N, row bytes] u8 (V4.1: ``nvfp4``; V4: ``fmt`` too) or None; ``idx`` [B, L]: with ``cmp``
    its first ``ring_slots(W)`` slots name ring rows and the rest compressed rows, else every slot a
    ring row; -1 none. With ``rotary``, the output in the activation dtype is rotated by -P at the
    queries' ``positions`` (host [B]) as the ``rope`` op does (model.md 2.5.6: what ``wo_a``
    takes). ``lens`` (host [B], optional): each query's list length; its slots past it are dead
    (a V4 HCA layer's: every row it sees, which the padded list names anyway). FP32 out."""
    from ...kernels_spec.sparse_mqa_decode import own_list
    from ...kernels_spec.sparse_mqa_decode_fp8 import ring_slots

    d, size = q.shape[-1], ring.shape[1]
    rows = decode_rows(ring, d, fmt)
    if lens is not None:
        idx = own_list(idx, lens)
    if cmp is not None:
        rows = torch.cat([rows, decode_rows(cmp, d, "nvfp4" if fmt == "fp8/32" else fmt)], 1)
        far = torch.arange(idx.shape[1], device=idx.device)[None, :] >= ring_slots(size)
        idx = torch.where(far & (idx >= 0), idx + size, idx)  # into the ring's rows, then the others
    each = torch.arange(rows.shape[0], device=rows.device)[:, None]
    keys = rows[each, idx.long().clamp(min=0)].to(q.dtype)
    out = attention_with_sink(ctx.ops, q, keys, idx >= 0, sink, scale)
    return out if rotary is None else rotary.apply(ctx.act(out), positions, inverse=True)


@model_op("kv_insert")
def kv_insert(ctx: Ctx, rotary: Rotary, x: torch.Tensor, weight: torch.Tensor, eps: float,
              positions: torch.Tensor, ring: torch.Tensor, fmt: str = "fp8/32") -> None:
    """A decode step's window rows into their rings as stored: each token's ``x`` [B, d] (the
    ``wkv`` projection) normed, rotated at its position (host [B]), rounded to the ring's format
    ``fmt`` (``stored.py``: V4.1's ``fp8/32``, V4's ``fp8_nope``) and written as bytes at slot P
    mod W of its sequence's ring ``ring`` [B, W, row bytes] (the rings' stack), each step in the
    activation dtype as the prefill path takes it."""
    kv = ctx.act(rms_norm(ctx, x, weight, eps))
    kv = ctx.act(rope(ctx, rotary, kv, positions))
    rows = kv_encode(ctx, round_kv(ctx, kv, fmt), fmt)
    each = torch.arange(ring.shape[0], device=ring.device)
    ring[each, ship(positions % ring.shape[1], ring.device)] = rows


def round_kv(ctx: Ctx, kv: torch.Tensor, fmt: str) -> torch.Tensor:
    """Window rows rounded to what a ring of format ``fmt`` holds, in the activation dtype: every
    channel FP8 with a code a 32 (``fp8/32``), or the nope channels FP8 with a code a 64 and the
    rope channels as they are (``fp8_nope``)."""
    if fmt == "fp8/32":
        return ctx.act(round_rows(ctx, kv, "fp8/32"))
    nope = kv.shape[-1] - NOPE_ROPE
    return ctx.act(torch.cat([round_rows(ctx, kv[..., :nope], f"fp8/{NOPE_BLOCK}"), kv[..., nope:].float()], -1))


@model_op("kv_encode")
def kv_encode(ctx: Ctx, t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows [T, d] as the cache stores them (``stored.py``), u8 [T, row bytes], each row its
    values, then its scales: ``fp8/32`` (d e4m3 values, a UE8M0 code per 32 channels; the
    ``quantize`` kernel's, its floor 2^-118, so that rows already rounded to the format keep their
    values), ``fp8_nope`` (V4's: the nope channels so, a code per 64, the 64 rope channels' BF16
    bytes between values and codes, the codes padded to 8 bytes), ``nvfp4`` (e2m1 codes two a
    byte, an E4M3 scale per 16) or ``mxfp4`` (a UE8M0 code per 32)."""
    from ...kernels_spec.quantize import quantize_reference
    from ...kernels_spec.quantize_fp4 import quantize_fp4_reference

    if fmt == "fp8/32":
        out = quantize_reference(t, BLOCK=FP8_BLOCK, FLOOR=KV_ENCODE_FLOOR)
        return torch.cat([out["q"].view(torch.uint8), out["scale"]], -1)
    if fmt == "fp8_nope":
        nope = t.shape[-1] - NOPE_ROPE
        out = quantize_reference(t[..., :nope].contiguous(), BLOCK=NOPE_BLOCK, FLOOR=KV_ENCODE_FLOOR)
        return nope_row_bytes(out["q"].view(torch.uint8), t[..., nope:], out["scale"])
    if fmt in ("nvfp4", "mxfp4"):
        out = quantize_fp4_reference(t, fmt)
        return torch.cat([out["q"], out["scale"]], -1)
    raise ValueError(f"kv_encode: format {fmt!r}: fp8/32, fp8_nope, nvfp4 or mxfp4")


def nope_row_bytes(values: torch.Tensor, rope: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """V4's rows (``fp8_nope``) from their parts: the nope channels' e4m3 bytes, the rope
    channels' BF16 bytes, the UE8M0 codes, zero bytes to a multiple of 8 codes."""
    pad = codes.new_zeros(*codes.shape[:-1], -codes.shape[-1] % 8)
    return torch.cat([values, rope.to(torch.bfloat16).contiguous().view(torch.uint8), codes, pad], -1)


def _decode_keys(seqs: list, layer: int, kv: torch.Tensor, compressed) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend``'s rows when each sequence brings one token: the rings as one stack (`stacked.py`),
    the new rows written first (slot P mod W held position P - W, outside P's window), then each
    query's W window rows in position order, and its compressed rows, by one gather each; the
    same rows, padding and validity as the per-sequence path."""
    from ..stacked import stack_attr

    rings = stack_attr([seq.cache.layers[layer] for seq, _ in seqs], "ring")
    b, size, dev = len(seqs), rings.shape[1], rings.device
    pos = ship(torch.tensor([seq.start for seq, _ in seqs]), dev)
    each = torch.arange(b, device=dev)
    rings[each, pos % size] = kv.to(rings.dtype)
    window = pos[:, None] - size + 1 + torch.arange(size, device=dev)[None, :]  # positions P - W + 1 .. P
    keys, valid = rings[each[:, None], window % size].to(kv.dtype), window >= 0
    if compressed is None:
        return keys, valid
    store = stack_attr(compressed.stores, "data")
    if isinstance(compressed, Selected):
        sel = torch.cat(compressed.sel)
        rows, seen = store[each[:, None], sel.clamp(min=0)], sel >= 0
    else:
        n = max(s.n for s in compressed.stores)
        rows = store[:, :n]
        seen = torch.arange(n, device=dev)[None, :] < ship(torch.cat(compressed.n_visible), dev)[:, None]
    return torch.cat([keys, rows.to(keys.dtype)], 1), torch.cat([valid, seen], 1)


def write_ring(ring, start: int, new_rows: torch.Tensor, encoded: torch.Tensor | None = None) -> None:
    """Store the chunk's rows at slot `pos % W` (only the last W matter); a ring as stored takes
    their bytes (``encoded``)."""
    size = ring.shape[0]
    s = new_rows.shape[0]
    keep = min(s, size)
    slots = ship(torch.arange(start + s - keep, start + s) % size, ring.device)
    if isinstance(ring, StoredRing):
        ring.write(slots, encoded[s - keep :])
    else:
        ring[slots] = new_rows[s - keep :].to(ring.dtype)


def window_kv(ctx: Ctx, attn, kvw: torch.Tensor, pos: torch.Tensor, seqs: list, fmt: str):
    """A step's window rows of layer ``attn`` (its ``kv_norm``, rotary and cache layer) from their
    projection ``kvw`` (``wkv`` of the step's rows), normed, rotated and rounded to the rings'
    format ``fmt``, and, over rings as stored, their
    bytes; a decode step over rings as stored writes them into the rings at once (``kv_insert``)
    and returns neither (its attention reads the rings)."""
    from ..stacked import stack_attr

    eps, rings = attn.cfg.rms_norm_eps, [seq.cache.layers[attn.layer].ring for seq, _ in seqs]
    stored = ctx.quant and isinstance(rings[0], StoredRing)
    if stored and one_token_each(seqs):
        kv_insert(ctx, attn.rope, kvw, attn.kv_norm, eps, pos, stack_attr(rings, "rows"), fmt=fmt)
        return None, None
    kv = ctx.act(rms_norm(ctx, kvw, attn.kv_norm, eps))
    kv = ctx.act(rope(ctx, attn.rope, kv, pos))
    if not ctx.quant:
        return kv, None
    kv = round_kv(ctx, kv, fmt)
    return kv, kv_encode(ctx, kv, fmt) if stored else None  # the rounded rows' bytes: their values kept
