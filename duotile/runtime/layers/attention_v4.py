"""V4 attention: sliding window + CSA (overlapping ratio-4 compressor, lightning indexer) or HCA (model.md 2.5)."""

from __future__ import annotations

import torch

from .. import quant
from ..cache import append_each
from ..config import ModelConfig
from ..device import ship
from ..stacked import stack_attr
from ..stored import PackedRows
from .attention_site import AttentionSite
from .cache_rows import Selected, Visible, attend, kv_encode, round_kv, window_kv
from .common import (
    Ctx,
    Rotary,
    WeightSource,
    index_scores,
    matmul,
    pad_cat,
    rms_norm,
    rope,
    round_rows,
    topk,
)
from .compressor import pool_all
from .step import Step, one_token_each


class Compressor:
    """Per-token value/score projections (FP32, BF16 weights) + pooling + norm + rope + rounding."""

    def __init__(self, ws: WeightSource, prefix: str, ratio: int, overlap: bool, eps: float):
        self.wkv, self.wgate = ws.t(prefix + "wkv.weight"), ws.t(prefix + "wgate.weight")
        self.ape, self.norm = ws.t(prefix + "ape"), ws.t(prefix + "norm.weight")
        self.ratio, self.overlap, self.eps = ratio, overlap, eps

    def project(self, ctx: Ctx, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = matmul(ctx, x, self.wkv)
        z = matmul(ctx, x, self.wgate) + self.ape[ship(positions % self.ratio, self.ape.device)]
        return c, z

    def pool(self, ctx: Ctx, states: list, c, z, seqs: list) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The step's pooled rows of every sequence's completed windows, their positions, the counts."""
        return pool_all(ctx, states, c, z, seqs, self.ratio, self.overlap)

    def finish(self, ctx: Ctx, pooled: torch.Tensor, pos: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Normalised, rotated rows (act dtype, unrounded): row by row, so the pooled rows of every
        sequence of a step go through at once."""
        rows = ctx.act(rms_norm(ctx, pooled, self.norm, self.eps))
        return ctx.act(rope(ctx, rotary, rows, pos))


def _append_pooled(ctx: Ctx, comp: Compressor, states: list, c, z, seqs: list, rotary: Rotary, round_fn,
                   stores: list) -> None:
    """Pool the step (``comp.pool``), then ``comp.finish`` and ``round_fn`` over every sequence's rows
    in one call each, each sequence's rows appended to its store (``stores``, `cache.Rows`)."""
    rows, pos, counts = comp.pool(ctx, states, c, z, seqs)
    if not rows.shape[0]:
        return
    append_each(stores, round_fn(comp.finish(ctx, rows, pos, rotary)), counts, stack=one_token_each(seqs))


def round_kv_nope(ctx: Ctx, kv: torch.Tensor) -> torch.Tensor:
    """(Q) FP8 e4m3 round trip of the nope channels, UE8M0 per 64; rope channels untouched."""
    return round_kv(ctx, kv, "fp8_nope") if ctx.quant else kv


class AttentionV4(AttentionSite):
    per_head_norm = True

    def __init__(self, cfg: ModelConfig, ws: WeightSource, layer: int):
        p = f"layers.{layer}.attn."
        self.cfg, self.layer, self.kind, self.ratio = cfg, layer, cfg.attention_kind(layer), cfg.ratio(layer)
        self.wq_a, self.wq_b, self.wkv = ws.linear(p + "wq_a"), ws.linear(p + "wq_b"), ws.linear(p + "wkv")
        self.q_norm, self.kv_norm = ws.t(p + "q_norm.weight"), ws.t(p + "kv_norm.weight")
        # wo_a runs as a BF16 matrix per group (grouped_output) or, with fp8_wo_a, on its FP8 codes
        self.wo_a, self.wo_b = ws.grouped_output_weight(p + "wo_a"), ws.linear(p + "wo_b")
        self.sink = ws.t(p + "attn_sink")
        self.rope = Rotary(cfg, self.ratio > 0, ws.device)
        eps = cfg.rms_norm_eps
        if self.ratio:
            self.comp = Compressor(ws, p + "compressor.", self.ratio, self.kind == "csa", eps)
        if self.kind == "csa":
            self.idx_wq_b, self.idx_proj = ws.linear(p + "indexer.wq_b"), ws.t(p + "indexer.weights_proj.weight")
            self.idx_comp = Compressor(ws, p + "indexer.compressor.", 4, True, eps)
            self.hadamard = quant.hadamard(cfg.index_head_dim, ws.device)

    def _index_round(self, ctx: Ctx, t: torch.Tensor, stored: bool = False) -> torch.Tensor:
        """(Q) Hadamard-128 then MXFP4 on index queries / keys; ``stored``: the keys' MXFP4 bytes
        (``kv_encode``), which decode to the rounded values."""
        if not ctx.quant:
            return t
        if stored:
            return kv_encode(ctx, matmul(ctx, t, self.hadamard), "mxfp4")
        return ctx.act(round_rows(ctx, matmul(ctx, t, self.hadamard), "mxfp4"))

    def _compress(self, ctx: Ctx, seqs: list, c, z, index, pos: torch.Tensor) -> list[torch.Tensor] | None:
        """Append the compressed rows (and, CSA, the index keys) of the windows each sequence's chunk
        completes, each pooled on its own state and then all rows at once; CSA: each sequence's
        selected rows (its own index scores, one top-k for all), else None."""
        cfg = self.cfg
        layers = [seq.cache.layers[self.layer] for seq, _ in seqs]
        stored = ctx.quant and isinstance(layers[0].comp, PackedRows)  # rows as their bytes (stored.py)

        def rows(r):  # the compressed rows as the store keeps them
            r = round_kv_nope(ctx, r)
            return kv_encode(ctx, r, "fp8_nope") if stored else r

        _append_pooled(ctx, self.comp, [lc.comp_state for lc in layers], c, z, seqs, self.rope, rows,
                       [lc.comp for lc in layers])
        if index is None:
            return None
        ci, zi, qi, wts = index
        _append_pooled(ctx, self.idx_comp, [lc.index_state for lc in layers], ci, zi, seqs, self.rope,
                       lambda r: self._index_round(ctx, r, stored), [lc.index_keys for lc in layers])
        if one_token_each(seqs):  # a decode step: each query its sequence's keys (values, or MXFP4 rows)
            stores = [lc.index_keys for lc in layers]
            keys = stack_attr(stores, stores[0].planes[0])
            return list(topk(ctx, index_scores(ctx, qi, wts, keys, (pos + 1) // self.ratio), cfg.index_topk).split(1))
        scores = [index_scores(ctx, qi[sl], wts[sl], lc.index_keys.stored, (pos[sl] + 1) // self.ratio)
                  for lc, (_, sl) in zip(layers, seqs)]
        return list(topk(ctx, pad_cat(scores, float("-inf")), cfg.index_topk).split([len(s) for s in scores]))

    @property
    def indexed(self) -> bool:
        return self.kind == "csa"

    def heads(self, ctx: Ctx, x: torch.Tensor, step: Step, projected: tuple | None = None) -> torch.Tensor:
        """The heads' outputs [T, H, d] for the step's rows ``x``; ``projected``: ``project(ctx, x)``,
        made already (a graph's)."""
        pos, d = step.positions, self.cfg.head_dim
        q, kvw, *index = projected if projected is not None else self.project(ctx, x)
        q = ctx.act(rope(ctx, self.rope, q, pos))
        seqs = list(zip(step.seqs, step.slices))
        kv, encoded = window_kv(ctx, self, kvw, pos, seqs, "fp8_nope")
        if self.ratio:
            c, z = self.comp.project(ctx, x, pos)
        if self.kind == "csa":
            ci, zi = self.idx_comp.project(ctx, x, pos)
            qi, wts = index
            qi = self._index_round(ctx, ctx.act(rope(ctx, self.rope, qi, pos)))
        compressed = None
        if self.ratio:
            sel = self._compress(ctx, seqs, c, z, (ci, zi, qi, wts) if self.kind == "csa" else None, pos)
            stores = [seq.cache.layers[self.layer].comp for seq, _ in seqs]
            if sel is not None:
                compressed = Selected(stores, sel)
            else:  # HCA: every row a query can see
                compressed = Visible(stores, [(pos[sl] + 1) // self.ratio for _, sl in seqs])
        # rotated by -P: in the decode kernel's epilogue over rings as stored, else by the rope op
        o = attend(ctx, seqs, self.layer, q, kv, compressed, self.sink, d**-0.5, encoded, self.rope, pos)
        return o
