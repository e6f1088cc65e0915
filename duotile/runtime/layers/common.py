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
from ..graphs import Sections
from ..model_ops import Tally, model_op
from ..ops import FastOps
from ..stored import decode_rows


@dataclass
class Ctx:
    ops: FastOps
    dtype: torch.dtype = torch.bfloat16
    quant: bool = True
    tally: Tally = field(default_factory=Tally)  # calls per model op, generated or reference (model_ops.py)
    # the grouped wo_a's (groups, FP8 block) where it runs as engines run it, on FP8 activations (a
    # decode kernel may write them with its output); None: in BF16, as the reference (model.md 2.10)
    fp8_wo_a: tuple[int, int] | None = None
    sections: Sections | None = None  # CUDA graphs of the shape-static sections (graphs.py); None: eager


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


def grouped_output(ctx: Ctx, o: torch.Tensor, wo_a: Linear, wo_b: Linear, groups: int) -> torch.Tensor:
    """Grouped low-rank output projection (model.md 2.5.7); o [T, H*d] -> [T, D] in the act dtype.
    The reference runs ``wo_a`` in BF16 on its dequantised weight with no activation quantisation;
    with ``ctx.fp8_wo_a`` as engines do (``grouped_linear_q``)."""
    t = o.shape[0]
    og = o.view(t, groups, -1)
    if ctx.fp8_wo_a and ctx.quant and wo_a.act_block:
        y = ctx.act(grouped_linear_q(ctx, og, wo_a))
    else:
        wa = wo_a.weight.view(groups, -1, og.shape[-1])
        y = ctx.act(torch.cat([matmul(ctx, og[:, g], wa[g]) for g in range(groups)], -1))
    return ctx.act(wo_b(ctx, y))


@model_op("grouped_linear_q")
def grouped_linear_q(ctx: Ctx, og: torch.Tensor, wo_a: Linear) -> torch.Tensor:
    """``wo_a`` as engines run it (model.md 2.5.7, 2.10's note): each group's activation [T, K]
    quantised as every FP8 GEMM's is (e4m3, a UE8M0 scale per ``act_block`` channels), times the
    group's FP8 weight block [N, K]; FP32 [T, G * N], the groups side by side."""
    t, groups, k = og.shape
    x = quant.act_quant(og.reshape(t, groups * k), wo_a.act_block).view(t, groups, k)
    wa = wo_a.weight.view(groups, -1, k)
    return torch.cat([ctx.ops.linear(x[:, g], wa[g]) for g in range(groups)], -1)


class WeightSource:
    """Hands out a checkpoint's tensors on a device, wrapped as `Linear` where they are GEMMs.

    ``packed``: quantised weights also keep their stored codes (what the block-scaled kernels read);
    ``dequantised=False`` keeps those codes alone, as released, and nothing in FP32 beside them.
    ``device_bytes`` counts what was placed on the device."""

    def __init__(self, checkpoint, device: torch.device | str = "cpu", packed: bool = False,
                 dequantised: bool = True, fp8_wo_a: bool = False):
        if not (packed or dequantised):
            raise ValueError("WeightSource: keep the packed codes, the dequantised weights, or both")
        self.ckpt, self.device, self.packed, self.dequantised = checkpoint, device, packed, dequantised
        self.fp8_wo_a = fp8_wo_a  # wo_a read by the block-scaled GEMM, not as a matrix (grouped_output)
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

    def grouped_output_weight(self, name: str) -> Linear:
        """The grouped ``wo_a``: with ``fp8_wo_a`` a weight like the others (its codes are what the
        block-scaled GEMM reads); else a matrix per group (the reference's BF16 product), its
        dequantised value kept whatever the source keeps. Where the source keeps codes alone (the
        generated kernels) that value is kept in BF16, which holds every e4m3 code times a power of
        two exactly (checked), 2 bytes a weight where FP32 and its codes took 5; the reference
        ops keep FP32."""
        if self.fp8_wo_a or not self.quantised(name):
            return self.linear(name, dequantised=None if self.fp8_wo_a else True)
        value = self.ckpt.get(self.weight_name(name))
        if not self.dequantised:
            as_bf16 = value.to(torch.bfloat16)
            if torch.equal(as_bf16.float(), value.float()):
                value = as_bf16
        return Linear(self._placed(value), self.act_block, None, self.weight_block)

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
