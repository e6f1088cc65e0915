"""V4.1 CSA2 attention: Full / Reindex / Reuse layers over shared compressed KV (model.md 2.13).

* Full (KV-source) layers own a compressor - ratio 2: gated 2-token softmax pooling without overlap
  or ape; ratio 1: a per-token projection - whose normalised output is the latent. The main row is
  NVFP4(rope(latent, first token of the group)); the index key is MXFP4(rope(k_norm(latent @ Wk^T))).
* Index sources (Full and Reindex layers) score visible rows with their own index queries. The
  candidate source additionally publishes a per-query candidate pool (blocks of `candidate_block_size`
  compressed positions, block score = max, newest block forced in, top `candidate_topk_blocks`);
  Reindex layers score only that pool. Reuse layers take the preceding source's top-k unchanged.
* Attention: the layer's own window (FP8 with UE8M0 per 32 over all channels) + the selected rows of
  its KV source, one softmax with the sink; no per-head query norm.
"""

from __future__ import annotations

import torch

from ..cache import append_each
from ..config import ModelConfig
from ..device import ship
from ..model_ops import model_op
from ..stacked import stack_attr
from ..stored import PackedRows
from .attention_site import AttentionSite
from .cache_rows import Selected, attend, kv_encode, window_kv
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


def candidate_pool(scores: torch.Tensor, n_visible: torch.Tensor, block: int, topk_blocks: int) -> torch.Tensor:
    """Boolean [S, N] pool: top blocks by max score, the newest visible block always kept."""
    s, n = scores.shape
    n_visible = ship(n_visible, scores.device)
    nb = -(-n // block)
    padded = torch.cat([scores, scores.new_full((s, nb * block - n), float("-inf"))], 1)
    block_scores = padded.view(s, nb, block).amax(-1)
    newest = (n_visible - 1) // block
    ids = torch.arange(nb, device=scores.device)
    block_scores = block_scores.masked_fill((ids[None, :] == newest[:, None]) & (n_visible[:, None] > 0), float("inf"))
    chosen = torch.sort(block_scores, dim=-1, descending=True, stable=True).indices[:, :topk_blocks]
    keep = torch.zeros(s, nb, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, chosen, block_scores.gather(1, chosen) > float("-inf"))
    pool = keep.repeat_interleave(block, 1)[:, :n]
    return pool & (torch.arange(n, device=scores.device)[None, :] < n_visible[:, None])


def pool_blocks(pool: torch.Tensor, block: int, topk_blocks: int) -> torch.Tensor:
    """The block list of a boolean pool [S, N]: the blocks holding a pool position, ascending, -1
    after them, [S, topk_blocks] int32 (the ``candidate_pool`` kernel's ``blocks``)."""
    s, n = pool.shape
    nb = -(-n // block)
    held = torch.cat([pool, pool.new_zeros(s, nb * block - n)], 1).view(s, nb, block).any(-1)
    ids = torch.where(held, torch.arange(nb, device=pool.device), nb).sort(-1).values[:, :topk_blocks]
    out = torch.full((s, topk_blocks), -1, dtype=torch.int32, device=pool.device)
    out[:, :ids.shape[1]] = torch.where(ids < nb, ids, -1).to(torch.int32)
    return out


@model_op("candidate_pool")
def pick_pool(ctx: Ctx, scores: torch.Tensor, n_visible: torch.Tensor, block: int, topk_blocks: int) -> torch.Tensor:
    """``candidate_pool`` as the model op: the pool's block list [S, topk_blocks] (``pool_blocks``),
    whose positions alone a Reindex layer scores (``index_scores_pool``)."""
    return pool_blocks(candidate_pool(scores, n_visible, block, topk_blocks), block, topk_blocks)


def pool_columns(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """The position of each column of a pool's scores [S, KB * block] (int64): column c is
    ``blocks[s, c // block] * block + c % block``, -1 where the block slot is empty."""
    ids = blocks.long().repeat_interleave(block, 1)
    offs = torch.arange(ids.shape[1], device=blocks.device) % block
    return torch.where(ids >= 0, ids * block + offs, -1)


def pool_to_positions(sel: torch.Tensor, blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Columns of a pool's scores (a ``select_topk`` result: -1 empty) as positions. The columns
    run in ascending positions (the blocks ascending), so an ascending selection stays ascending."""
    col = sel.clamp(min=0)
    p = blocks.long().gather(1, col // block) * block + col % block
    return torch.where(sel >= 0, p, -1)


@model_op("index_scores_pool")
def index_scores_pool(ctx: Ctx, qi: torch.Tensor, wts: torch.Tensor, keys: torch.Tensor, n_visible: torch.Tensor,
                      blocks: torch.Tensor, block: int) -> torch.Tensor:
    """A Reindex layer's scores of its candidate pool alone (model.md 2.13), [S, KB * block] in
    candidate order (``pool_columns``): the full row's ``index_scores`` at each column's position,
    -inf for an empty block slot or a position not visible. ``keys`` [S, N, c] (a decode step's
    queries, each its own) or [N, c] (a prefill chunk's, one sequence's, which every query reads)."""
    full = index_scores.__wrapped__(ctx, qi, wts, keys, n_visible)
    p = pool_columns(ship(blocks, full.device), block)
    live = (p >= 0) & (p < full.shape[1])
    if not full.shape[1]:
        return full.new_full(p.shape, float("-inf"))
    return full.gather(1, torch.where(live, p, 0)).masked_fill(~live, float("-inf"))


class AttentionV41(AttentionSite):
    def __init__(self, cfg: ModelConfig, ws: WeightSource, layer: int):
        p = f"layers.{layer}.attn."
        self.cfg, self.layer, self.kind, self.ratio = cfg, layer, cfg.attention_kind(layer), cfg.ratio(layer)
        self.wq_a, self.wq_b, self.wkv = ws.linear(p + "wq_a"), ws.linear(p + "wq_b"), ws.linear(p + "wkv")
        self.q_norm, self.kv_norm = ws.t(p + "q_norm.weight"), ws.t(p + "kv_norm.weight")
        # wo_a runs as a BF16 matrix per group (grouped_output) or, with fp8_wo_a, on its FP8 codes
        self.wo_a, self.wo_b = ws.grouped_output_weight(p + "wo_a"), ws.linear(p + "wo_b")
        self.sink = ws.t(p + "attn_sink")
        self.rope = Rotary(cfg, self.ratio > 0, ws.device)
        if self.kind == "full":
            self.c_wkv, self.c_norm = ws.t(p + "compressor.wkv.weight"), ws.t(p + "compressor.norm.weight")
            self.c_wgate = ws.t(p + "compressor.wgate.weight") if self.ratio > 1 else None
            self.wk, self.k_norm = ws.t(p + "indexer.wk.weight"), ws.t(p + "indexer.k_norm.weight")
        if self.kind in ("full", "reindex"):
            self.idx_wq_b, self.idx_proj = ws.linear(p + "indexer.wq_b"), ws.t(p + "indexer.weights_proj.weight")
        if self.ratio:
            self.kv_src, self.idx_src = cfg.kv_source(layer), cfg.index_source(layer)

    def _publish(self, ctx: Ctx, seqs: list, x: torch.Tensor) -> None:
        """Full layer: append main rows and index keys of the groups each sequence's chunk completes
        to its storage. Each sequence pools on its own state; the rows of all go through at once."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        c = matmul(ctx, x, self.c_wkv)
        if self.ratio == 1:
            latent = ctx.act(rms_norm(ctx, c, self.c_norm, eps))
            counts = [sl.stop - sl.start for _, sl in seqs]
            pos = torch.cat([torch.arange(n) + seq.start for n, (seq, _) in zip(counts, seqs)])
        else:
            z = matmul(ctx, x, self.c_wgate)
            states = [seq.cache.layers[self.layer].comp_state for seq, _ in seqs]
            pooled, pos, counts = pool_all(ctx, states, c, z, seqs, self.ratio, overlap=False)
            if not pooled.shape[0]:
                return
            latent = ctx.act(rms_norm(ctx, pooled, self.c_norm, eps))
        main = ctx.act(rope(ctx, self.rope, latent, pos))
        key = ctx.act(rms_norm(ctx, matmul(ctx, latent, self.wk), self.k_norm, cfg.rms_norm_eps))
        key = ctx.act(rope(ctx, self.rope, key, pos))
        lcs, decode = [seq.cache.layers[self.layer] for seq, _ in seqs], one_token_each(seqs)
        stored = isinstance(lcs[0].comp, PackedRows)
        if ctx.quant and stored:  # encoded from the unrounded values (an NVFP4 value may not re-encode)
            main, key = kv_encode(ctx, main, "nvfp4"), kv_encode(ctx, key, "mxfp4")
        elif ctx.quant:
            main, key = ctx.act(round_rows(ctx, main, "nvfp4")), ctx.act(round_rows(ctx, key, "mxfp4"))
        append_each([lc.comp for lc in lcs], main, counts, stack=decode)
        append_each([lc.index_keys for lc in lcs], key, counts, stack=decode)

    def _select(self, ctx: Ctx, seqs: list, qi, wts, pos: torch.Tensor) -> list[torch.Tensor]:
        """Each sequence's selected compressed rows: its own index scores, one top-k for all."""
        cfg = self.cfg
        if self.kind == "reuse":
            return [seq.scratch[("topk", self.idx_src)] for seq, _ in seqs]
        if one_token_each(seqs):
            return self._select_decode(ctx, seqs, qi, wts, pos)
        if self.kind == "reindex":
            return self._select_pool(ctx, seqs, qi, wts, pos)
        scores = []
        for seq, sl in seqs:
            n_vis = (pos[sl] + 1) // self.ratio
            s = index_scores(ctx, qi[sl], wts[sl], seq.cache.layers[self.kv_src].index_keys.stored, n_vis)
            if self.layer == cfg.candidate_source_layer_id:
                seq.scratch["pool_blocks"] = pick_pool(ctx, s, n_vis, cfg.candidate_block_size,
                                                       cfg.candidate_topk_blocks)
            scores.append(s)
        sels = topk(ctx, pad_cat(scores, float("-inf")), cfg.index_topk).split([len(s) for s in scores])
        for (seq, _), sel in zip(seqs, sels):
            seq.scratch[("topk", self.layer)] = sel
        return list(sels)

    def _select_pool(self, ctx: Ctx, seqs: list, qi, wts, pos: torch.Tensor) -> list[torch.Tensor]:
        """A Reindex layer's prefill selection: each query scores only its candidate pool's
        positions (``index_scores_pool`` over its sequence's keys, which the chunk's queries share),
        the top-k of those columns for all at once, mapped back to positions: the rows of the full
        row masked by the pool, ties to the lowest position."""
        cfg, block = self.cfg, self.cfg.candidate_block_size
        scores, blocks = [], []
        for seq, sl in seqs:
            ids = seq.scratch["pool_blocks"]
            keys = seq.cache.layers[self.kv_src].index_keys.stored
            scores.append(index_scores_pool(ctx, qi[sl], wts[sl], keys, (pos[sl] + 1) // self.ratio, ids, block))
            blocks.append(ids)
        ids = torch.cat(blocks)
        chosen = pool_to_positions(topk(ctx, torch.cat(scores), cfg.index_topk), ship(ids, scores[0].device), block)
        sels = chosen.split([len(s) for s in scores])
        for (seq, _), sel in zip(seqs, sels):
            seq.scratch[("topk", self.layer)] = sel
        return list(sels)

    def _select_decode(self, ctx: Ctx, seqs: list, qi, wts, pos: torch.Tensor) -> list[torch.Tensor]:
        """``_select`` for a decode step: every sequence's query against its own index keys in one
        call (the keys as one stack, `stacked.py`, each row masked past what its sequence sees).
        The candidate source keeps its pool's block list per sequence (not the boolean row: no
        layer of a decode step reads it); a Reindex layer scores only the pool's positions
        (``index_scores_pool``: KB * block rows a query, not every visible one), takes the top-k of
        those columns and maps them back to positions: the rows the full row masked by the pool
        selects, ties to the lowest position."""
        cfg, stores = self.cfg, [seq.cache.layers[self.kv_src].index_keys for seq, _ in seqs]
        keys = stack_attr(stores, stores[0].planes[0])  # values, or MXFP4 rows as stored
        n_vis = (pos + 1) // self.ratio
        if self.kind == "reindex":
            block = cfg.candidate_block_size
            blocks = torch.cat([seq.scratch["pool_blocks"] for seq, _ in seqs])
            scores = index_scores_pool(ctx, qi, wts, keys, n_vis, blocks, block)
            chosen = pool_to_positions(topk(ctx, scores, cfg.index_topk), ship(blocks, scores.device), block)
        else:
            scores = index_scores(ctx, qi, wts, keys, n_vis)
            if self.layer == cfg.candidate_source_layer_id:
                blocks = pick_pool(ctx, scores, n_vis, cfg.candidate_block_size, cfg.candidate_topk_blocks)
                for (seq, _), ids in zip(seqs, blocks.split(1)):
                    seq.scratch["pool_blocks"] = ids
            chosen = topk(ctx, scores, cfg.index_topk)
        sels = chosen.split(1)
        for (seq, _), sel in zip(seqs, sels):
            seq.scratch[("topk", self.layer)] = sel
        return list(sels)

    @property
    def indexed(self) -> bool:
        return self.kind in ("full", "reindex")

    def heads(self, ctx: Ctx, x: torch.Tensor, step: Step, projected: tuple | None = None) -> torch.Tensor:
        """The heads' outputs [T, H, d] for the step's rows ``x``; ``projected``: ``project(ctx, x)``,
        made already (a graph's)."""
        pos, d = step.positions, self.cfg.head_dim
        q, kvw, *index = projected if projected is not None else self.project(ctx, x)
        q = ctx.act(rope(ctx, self.rope, q, pos))
        seqs = list(zip(step.seqs, step.slices))
        kv, encoded = window_kv(ctx, self, kvw, pos, seqs, "fp8/32")
        qi = wts = None
        if index:
            qi, wts = index
            qi = ctx.act(rope(ctx, self.rope, qi, pos))
            if ctx.quant:
                qi = ctx.act(round_rows(ctx, qi, "mxfp4"))
        if self.kind == "full":
            self._publish(ctx, seqs, x)
        sels = self._select(ctx, seqs, qi, wts, pos) if self.ratio else None

        compressed = Selected([seq.cache.layers[self.kv_src].comp for seq, _ in seqs], sels) if self.ratio else None
        # rotated by -P: in the decode kernel's epilogue over rings as stored, else by the rope op
        o = attend(ctx, seqs, self.layer, q, kv, compressed, self.sink, d**-0.5, encoded, self.rope, pos)
        return o
