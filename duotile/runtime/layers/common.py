"""Shared pieces: the per-step numeric context, quantised linears, rotary embedding, top-k selection.

`Ctx` carries the choices one forward step is made with: the ops flavour (fast or batch-invariant,
ops.py), the activation dtype (BF16 like the released reference, or FP32), and whether the
reference's quantisation round trips (model.md 2.10) are simulated. Turning `quant` off gives the
plain float model that Hugging Face transformers implements (model.md 1.6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import quant
from ..config import ModelConfig
from ..device import ship
from ..model_ops import Tally, model_op
from ..ops import FastOps
from ..stored import FP8_BLOCK, NOPE_BLOCK, NOPE_ROPE, StoredRing, decode_rows
from .step import one_token_each

# kv_encode's scale floor for FP8 rows: the quantize kernel's least, so that the only blocks it
# moves are those whose amax is below 2^-118 (rows the kv_round trip, with no floor, left finer)
KV_ENCODE_FLOOR = 2.0**-118


@dataclass
class Ctx:
    ops: FastOps
    dtype: torch.dtype = torch.bfloat16
    quant: bool = True
    tally: Tally = field(default_factory=Tally)  # calls per model op, generated or reference (model_ops.py)

    def act(self, t: torch.Tensor) -> torch.Tensor:
        """Round to the activation dtype, where the reference stores a BF16 tensor."""
        return t.to(self.dtype)


@model_op("rms_norm")
def rms_norm(ctx: Ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in FP32 (``weight`` None: the unweighted per-head norm)."""
    return ctx.ops.rms_norm(x, weight, eps)


@model_op("linear")
def matmul(ctx: Ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FP32 ``x @ w.T`` against an unquantised weight. Pass a BF16 activation as BF16, not upcast:
    the reference upcasts it, and a generated GEMM takes BF16 operands by their dtype."""
    return ctx.ops.linear(x, w)


@model_op("act_quant")
def act_quant(ctx: Ctx, x: torch.Tensor, block: int) -> torch.Tensor:
    """The FP8 e4m3 round trip of an activation, a UE8M0 scale per ``block`` channels."""
    return quant.act_quant(x, block)


class Linear:
    """`y = x @ W^T` in FP32 with the dequantised weight; FP8/FP4 weights first quantise the activation.

    ``packed`` holds the checkpoint's own codes where a kernel may read them: ``(kind, codes,
    scales)``: ``("fp8", e4m3 [N, K], UE8M0 codes [N / b, K / b])`` for FP8 blocks of b x b,
    ``("fp4", e2m1 pairs [N, K / 2] as uint8, UE8M0 codes [N, K / 32])`` for MXFP4 rows. A packed
    weight may come without its dequantised value (``weight=None``: weights kept as released, a
    quarter or an eighth of the FP32 bytes); ``weight`` then dequantises at each use (``block``:
    the FP8 blocks' size), never kept, which only the PyTorch reference path of such a layer pays."""

    def __init__(self, weight: torch.Tensor | None, act_block: int | None, packed: tuple | None = None,
                 block: int | None = None):
        if weight is None and packed is None:
            raise ValueError("Linear: give the weight, its packed codes, or both")
        self._weight, self.act_block, self.packed, self.block = weight, act_block, packed, block

    @property
    def weight(self) -> torch.Tensor:
        if self._weight is not None:
            return self._weight
        from ..quant import dequantize_packed

        return dequantize_packed(self.packed, self.block)

    def __call__(self, ctx: Ctx, x: torch.Tensor) -> torch.Tensor:
        if not self.act_block:
            return matmul(ctx, x, self.weight)
        return self._quantised(ctx, x)

    @model_op("linear_q")
    def _quantised(self, ctx: Ctx, x: torch.Tensor) -> torch.Tensor:
        if ctx.quant:
            x = act_quant(ctx, x, self.act_block)
        return ctx.ops.linear(x, self.weight)


class Rotary:
    """Interleaved RoPE on the last `qk_rope_head_dim` channels (model.md 2.4).

    Window-only layers: base `rope_theta`, plain. Compressed layers: base `compress_rope_theta` with
    YaRN frequency interpolation and no magnitude scaling. cos/sin are computed in blocks of 64
    positions with a fixed shape, so a position's values never depend on which batch asked for it.
    """

    BLOCK = 64

    def __init__(self, cfg: ModelConfig, compressed: bool, device: torch.device | str = "cpu"):
        dim = cfg.qk_rope_head_dim
        base = cfg.compress_rope_theta if compressed else cfg.rope_theta
        freqs = [base ** (-2.0 * i / dim) for i in range(dim // 2)]
        if compressed and cfg.rope_factor > 1:
            orig = cfg.original_max_position_embeddings
            corr = lambda k: dim * math.log(orig / (k * 2 * math.pi)) / (2 * math.log(base))
            low = max(math.floor(corr(cfg.beta_fast)), 0)
            high = min(math.ceil(corr(cfg.beta_slow)), dim - 1)
            ramp = [min(max((i - low) / max(high - low, 1e-3), 0.0), 1.0) for i in range(dim // 2)]
            freqs = [f / cfg.rope_factor * r + f * (1 - r) for f, r in zip(freqs, ramp)]
        self.freqs = torch.tensor(freqs, dtype=torch.float32, device=device)
        self.dim = dim
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _block(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._blocks.get(b)
        if cached is None:
            pos = torch.arange(b * self.BLOCK, (b + 1) * self.BLOCK, device=self.freqs.device).float()
            angle = pos[:, None] * self.freqs[None, :]
            cached = self._blocks[b] = (torch.cos(angle), torch.sin(angle))
        return cached

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope/2] for integer positions [T] (CPU)."""
        lo, hi = int(positions.min()) // self.BLOCK, int(positions.max()) // self.BLOCK
        tables = [self._block(b) for b in range(lo, hi + 1)]
        idx = ship(positions - lo * self.BLOCK, self.freqs.device)
        return torch.cat([c for c, _ in tables])[idx], torch.cat([s for _, s in tables])[idx]

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Rotate x [..., T, (heads,) C] by positions [T]; returns FP32. `inverse` rotates by -P."""
        if positions.numel() == 0:
            return x.float()
        cos, sin = self.cos_sin(positions)
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if inverse:
            sin = -sin
        x = x.float()
        rope = x[..., -self.dim :]
        a, b = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        return torch.cat([x[..., : -self.dim], rotated], dim=-1)


@model_op("rope")
def rope(ctx: Ctx, rotary: Rotary, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``rotary.apply``: x rotated by its positions (by -P with ``inverse``), FP32."""
    return rotary.apply(x, positions, inverse)


_ROUNDS = {
    "fp8/32": lambda t: quant.fp8_block_round(t, 32),
    "fp8/64": lambda t: quant.fp8_block_round(t, 64),
    "nvfp4": quant.nvfp4_round,
    "mxfp4": quant.mxfp4_round,
}


@model_op("kv_round")
def round_rows(ctx: Ctx, t: torch.Tensor, fmt: str) -> torch.Tensor:
    """The cache format's round trip of KV / index rows: FP8 e4m3 with UE8M0 per 32 or 64 channels
    (``fp8/32``, ``fp8/64``), NVFP4-like (``nvfp4``) or MXFP4 (``mxfp4``); FP32 out."""
    return _ROUNDS[fmt](t)


@model_op("topk")
def topk(ctx: Ctx, scores: torch.Tensor, k: int) -> torch.Tensor:
    """``select_topk`` as the model op."""
    return select_topk(scores, k)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k column indices per row (ties: lowest index), -inf picks as -1, sorted ascending, -1 last."""
    rows, n = scores.shape
    if n == 0:
        return torch.full((rows, k), -1, dtype=torch.long, device=scores.device)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    valid = scores.gather(-1, order) > float("-inf")
    key = torch.where(valid, order, torch.full_like(order, n)).sort(-1).values
    out = torch.where(key == n, torch.full_like(key, -1), key)
    if out.shape[1] < k:
        out = torch.cat([out, out.new_full((rows, k - out.shape[1]), -1)], 1)
    return out


@model_op("sparse_attention")
def sparse_attention(ctx: Ctx, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
    """One softmax over a per-query key set plus a value-less sink logit (model.md 2.5.6).

    q [S, H, d]; keys [S, L, d] (K = V); valid [S, L]. Returns o [S, H, d] in FP32.
    """
    return attention_with_sink(ctx.ops, q, keys, valid, sink, scale)


def attention_with_sink(ops, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """``sparse_attention``'s math on ``ops`` (fast or batch-invariant): the reference body of the
    three attention ops, which differ in how the rows reach it."""
    q, keys = q.float(), keys.float()
    if ops.invariant:
        logits = ops.sum(q[:, :, None, :] * keys[:, None, :, :], -1)
    else:
        logits = torch.einsum("shd,sld->shl", q, keys)
    logits = (logits * scale).masked_fill(~valid[:, None, :], float("-inf"))
    mx = logits.amax(-1, keepdim=True)
    e = ops.exp(logits - mx)
    den = ops.sum(e, -1) + ops.exp(sink[None, :] - mx.squeeze(-1))
    p = e / den.unsqueeze(-1)
    if ops.invariant:
        return ops.sum(p[..., None] * keys[:, None, :, :], 2)
    return torch.einsum("shl,sld->shd", p, keys)


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


def pad_cat(parts: list[torch.Tensor], fill) -> torch.Tensor:
    """Each sequence's rows [S_i, L_i, ...] stacked, dim 1 padded to the longest with ``fill``: one call
    of a row-wise op for a step's sequences (padding at the end changes no row's result)."""
    width = max(p.shape[1] for p in parts)
    if all(p.shape[1] == width for p in parts):
        return torch.cat(parts)
    out = parts[0].new_full((sum(p.shape[0] for p in parts), width, *parts[0].shape[2:]), fill)
    at = 0
    for p in parts:
        out[at : at + p.shape[0], : p.shape[1]] = p
        at += p.shape[0]
    return out


@dataclass
class Selected:
    """Each query's selected rows of its sequence's compressed store: ``sel[i]`` [S_i, K] row
    indices into ``stores[i]`` (`cache.Rows`), -1 for none."""

    stores: list
    sel: list[torch.Tensor]

    def rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's stored rows [n, d] and each query's indices into them [S_i, K] (-1 none)."""
        return self.stores[i].view, self.sel[i]


@dataclass
class Visible:
    """Every row of its sequence's store a query can see: the first ``n_visible[i]`` [S_i] (host)."""

    stores: list
    n_visible: list[torch.Tensor]

    def rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows, visible = self.stores[i].view, self.n_visible[i]
        at = torch.arange(rows.shape[0])[None, :].expand(len(visible), -1)
        return rows, torch.where(at < visible[:, None], at, -1)


def attend(ctx: Ctx, seqs: list, layer: int, q: torch.Tensor, kv: torch.Tensor, compressed, sink: torch.Tensor,
           scale: float, encoded: torch.Tensor | None, rotary: Rotary, positions: torch.Tensor) -> torch.Tensor:
    """A layer's sparse attention for a step's sequences (``(StepSeq, slice)`` pairs) as ``wo_a``
    takes it: the output's rope channels rotated by -P (``rotary`` at the queries' ``positions``,
    model.md 2.5.6), in the activation dtype. Each query's window rows, then its
    compressed rows (``Selected`` or ``Visible``; None: a window-only layer); each sequence's ring
    written after its rows were read; one ``sparse_attention`` over all queries (rows padded,
    masked), then the ``rope`` op. A decode step gathers every sequence's rows at once; over rings
    as stored (``stored.py``; ``encoded`` is then ``kv``'s bytes, ``kv_encode``) it reads them where
    they are and rotates in the same op (``sparse_attention_stored``)."""
    ring0 = seqs[0][0].cache.layers[layer].ring
    if one_token_each(seqs) and isinstance(ring0, StoredRing):
        return ctx.act(_stored_decode(ctx, seqs, layer, q, encoded, compressed, sink, scale, rotary))
    out = _attend_rows(ctx, seqs, layer, q, kv, compressed, sink, scale, encoded)
    return _inverse_rope(ctx, rotary, positions, out)


def _inverse_rope(ctx: Ctx, rotary: Rotary, positions: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The attention output ``out`` in the activation dtype, its rope channels rotated by -P (the
    ``rope`` op), in the activation dtype again."""
    return ctx.act(rope(ctx, rotary, ctx.act(out), positions, inverse=True))


def _attend_rows(ctx: Ctx, seqs: list, layer: int, q: torch.Tensor, kv: torch.Tensor, compressed, sink, scale,
                 encoded) -> torch.Tensor:
    """``attend``'s attention over rows held as values (a decode step's gathered at once, a chunk's
    by index lists), before the rotation."""
    ring0 = seqs[0][0].cache.layers[layer].ring
    if one_token_each(seqs) and ring0.dtype == kv.dtype:
        keys, valid = _decode_keys(seqs, layer, kv, compressed)
        return sparse_attention(ctx, q, keys, valid, sink, scale)
    rows, idx, base = [], [], 0
    for i, (seq, sl) in enumerate(seqs):
        ring = seq.cache.layers[layer].ring
        r, ix = window_rows(ring, seq.start, kv[sl])
        if compressed is not None:
            extra, sel = compressed.rows(i)
            sel = ship(sel, ix.device)
            ix = torch.cat([ix, torch.where(sel >= 0, sel + r.shape[0], -1)], 1)
            r = torch.cat([r, extra.to(r.dtype)])
        rows.append(r)
        idx.append(torch.where(ix >= 0, ix + base, -1))
        base += r.shape[0]
        # its window rows above are a copy
        write_ring(ring, seq.start, kv[sl], None if encoded is None else encoded[sl])
    return sparse_attention_rows(ctx, q, torch.cat(rows), pad_cat(idx, -1), sink, scale)


@model_op("sparse_attention_rows")
def sparse_attention_rows(ctx: Ctx, q: torch.Tensor, rows: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """``sparse_attention`` of a chunk's queries [T, H, d] over rows they share: ``rows`` [N, d]
    (each sequence's window rows once, then its compressed rows), ``idx`` [T, L] each query's own
    (-1 none). FP32 out."""
    return attention_with_sink(ctx.ops, q, rows[idx.clamp(min=0)], idx >= 0, sink, scale)


def _stored_decode(ctx: Ctx, seqs: list, layer: int, q: torch.Tensor, encoded: torch.Tensor, compressed, sink,
                   scale, rotary: Rotary):
    """``attend`` of a decode step over rings as stored: the rings' rows as one stack, the new
    rows' bytes written first (slot P mod W), and one index list a query: its W window slots in
    position order (-1 before position 0), then its compressed rows (``Selected``: its selected
    ones; ``Visible``: every row it sees; -1 for none); the output rotated by -P in the op."""
    from ...kernels_spec.sparse_mqa_decode_fp8 import ring_slots
    from ..stacked import stack_attr

    rings = [seq.cache.layers[layer].ring for seq, _ in seqs]
    ring = stack_attr(rings, "rows")
    b, size, dev = ring.shape[0], ring.shape[1], ring.device
    host = torch.tensor([seq.start for seq, _ in seqs])
    pos = ship(host, dev)
    each = torch.arange(b, device=dev)
    if encoded is not None:  # (kv_insert wrote them already)
        ring[each, pos % size] = encoded
    window = pos[:, None] - size + 1 + torch.arange(size, device=dev)[None, :]  # positions P - W + 1 .. P
    idx = torch.where(window >= 0, window % size, -1)
    cmp = None
    if compressed is not None:  # the list's ring part is ring_slots(W) slots: -1 past the window's W
        cmp = stack_attr(compressed.stores, "rows")
        pad = idx.new_full((b, ring_slots(size) - size), -1)
        idx = torch.cat([idx, pad, ship(_compressed_slots(compressed), dev)], 1)
    return sparse_attention_stored(ctx, q, ring, idx.to(torch.int32), cmp, sink, scale, rings[0].fmt, rotary, host)


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
                            positions: torch.Tensor | None = None) -> torch.Tensor:
    """``sparse_attention`` of one query a sequence over its rows as stored: ``ring`` [B, W, row
    bytes] u8 in format ``fmt`` (``stored.py``: V4.1's ``fp8/32``, V4's ``fp8_nope``), ``cmp``
    [B, N, row bytes] u8 (V4.1: ``nvfp4``; V4: ``fmt`` too) or None; ``idx`` [B, L]: with ``cmp``
    its first ``ring_slots(W)`` slots name ring rows and the rest compressed rows, else every slot a
    ring row; -1 none. With ``rotary``, the output in the activation dtype is rotated by -P at the
    queries' ``positions`` (host [B]) as the ``rope`` op does (model.md 2.5.6: what ``wo_a``
    takes). FP32 out."""
    from ...kernels_spec.sparse_mqa_decode_fp8 import ring_slots

    d, size = q.shape[-1], ring.shape[1]
    rows = decode_rows(ring, d, fmt)
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


def grouped_output(ctx: Ctx, o: torch.Tensor, wo_a: Linear, wo_b: Linear, groups: int) -> torch.Tensor:
    """Grouped low-rank output projection (model.md 2.5.7); o [T, H*d] -> [T, D] in the act dtype."""
    t = o.shape[0]
    og = o.view(t, groups, -1)
    wa = wo_a.weight.view(groups, -1, og.shape[-1])
    ys = [matmul(ctx, og[:, g], wa[g]) for g in range(groups)]  # the reference runs wo_a in BF16, no act quant
    y = ctx.act(torch.cat(ys, -1))
    return ctx.act(wo_b(ctx, y))


class WeightSource:
    """Hands out a checkpoint's tensors on a device, wrapped as `Linear` where they are GEMMs.

    ``packed``: quantised weights also keep their stored codes (what the block-scaled kernels read);
    ``dequantised=False`` keeps those codes alone, as released, and nothing in FP32 beside them.
    ``device_bytes`` counts what was placed on the device."""

    def __init__(self, checkpoint, device: torch.device | str = "cpu", packed: bool = False,
                 dequantised: bool = True):
        if not (packed or dequantised):
            raise ValueError("WeightSource: keep the packed codes, the dequantised weights, or both")
        self.ckpt, self.device, self.packed, self.dequantised = checkpoint, device, packed, dequantised
        # the activations' quantisation block is the dense weights' block (model.md 2.10)
        self.act_block = self.weight_block = checkpoint.config.weight_block_size[0]
        self.device_bytes = 0

    def _placed(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        self.device_bytes += t.numel() * t.element_size()
        return t

    def t(self, name: str) -> torch.Tensor:
        return self._placed(self.ckpt.get(name))

    def weight_name(self, name: str) -> str:
        return name if name in self.ckpt.specs else name + ".weight"

    def quantised(self, name: str) -> bool:
        return self.ckpt.specs[self.weight_name(name)].kind in ("fp8", "fp4")

    def packed_codes(self, name: str) -> tuple[str, torch.Tensor, torch.Tensor]:
        kind, codes, scales = self.ckpt.packed(self.weight_name(name))
        return kind, self._placed(codes), self._placed(scales)

    def linear(self, name: str, packed: tuple | None = None, dequantised: bool | None = None) -> Linear:
        """``packed``: the weight's codes placed already (views of a stack of them, say);
        ``dequantised=True``: keep the dequantised value whatever the source keeps (a weight read
        as a matrix, not by a block-scaled kernel: the grouped ``wo_a``)."""
        weight_name = self.weight_name(name)
        if not self.quantised(name):
            return Linear(self.t(weight_name), None)
        if self.packed and packed is None:  # what the block-scaled GEMMs read (kernels "generated")
            packed = self.packed_codes(name)
        keep = self.dequantised if dequantised is None else dequantised
        return Linear(self.t(weight_name) if keep else None, self.act_block, packed, self.weight_block)

    def has(self, name: str) -> bool:
        return name in self.ckpt.specs


@model_op("index_scores")
def index_scores(ctx: Ctx, qi: torch.Tensor, wts: torch.Tensor, keys: torch.Tensor,
                 n_visible: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores s[i, j] = sum_h wts[i,h] * relu(qi[i,h] . k_j), -inf where j >= n_visible[i].

    ``keys`` [N, c] (one sequence's, every query reads them) or [S, N, c] (each query its own: a
    decode step's sequences at once). The q.k product is rounded to the activation dtype before the
    ReLU (the reference's BF16 einsum).
    """
    if keys.dtype == torch.uint8:  # MXFP4 rows as stored (``stored.PackedRows``)
        keys = decode_rows(keys, qi.shape[-1], "mxfp4")
    qi, keys = qi.float(), keys.float()
    each = keys if keys.dim() == 3 else keys[None]
    if ctx.ops.invariant:
        dots = ctx.ops.sum(qi[:, :, None, :] * each[:, None, :, :], -1)
    elif keys.dim() == 3:
        dots = torch.einsum("shc,snc->shn", qi, keys)
    else:
        dots = torch.einsum("shc,nc->shn", qi, keys)
    dots = torch.relu(ctx.act(dots).float()) * wts.float()[:, :, None]
    scores = ctx.ops.sum(dots, 1)
    cols = torch.arange(keys.shape[-2], device=scores.device)
    return scores.masked_fill(cols[None, :] >= ship(n_visible[:, None], scores.device), float("-inf"))


def window_kv(ctx: Ctx, attn, x: torch.Tensor, pos: torch.Tensor, seqs: list, fmt: str):
    """A step's window rows of layer ``attn`` (its ``wkv``, ``kv_norm``, rotary and cache layer),
    normed, rotated and rounded to the rings' format ``fmt``, and, over rings as stored, their
    bytes; a decode step over rings as stored writes them into the rings at once (``kv_insert``)
    and returns neither (its attention reads the rings)."""
    from ..stacked import stack_attr

    eps, rings = attn.cfg.rms_norm_eps, [seq.cache.layers[attn.layer].ring for seq, _ in seqs]
    stored = ctx.quant and isinstance(rings[0], StoredRing)
    if stored and one_token_each(seqs):
        kv_insert(ctx, attn.rope, attn.wkv(ctx, x), attn.kv_norm, eps, pos, stack_attr(rings, "rows"), fmt=fmt)
        return None, None
    kv = ctx.act(rms_norm(ctx, attn.wkv(ctx, x), attn.kv_norm, eps))
    kv = ctx.act(rope(ctx, attn.rope, kv, pos))
    if not ctx.quant:
        return kv, None
    kv = round_kv(ctx, kv, fmt)
    return kv, kv_encode(ctx, kv, fmt) if stored else None  # the rounded rows' bytes: their values kept
