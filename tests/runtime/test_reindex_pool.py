"""V4.1's Reindex layers score only the candidate pool's positions (``index_scores_pool``), at
decode and in a prefill chunk, where they scored every visible row and masked the rest with the
pool: the rows they select, and so a generation's logits, are the same bit for bit on the reference
ops, and its greedy tokens on generated kernels."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.engine import LLM
from duotile.runtime.layers import attention_v41
from duotile.runtime.layers.attention_v41 import AttentionV41, candidate_pool, pick_pool, pool_blocks
from duotile.runtime.layers.common import Ctx, index_scores, pad_cat, topk
from duotile.runtime.layers.step import one_token_each
from duotile.runtime.ops import FastOps
from duotile.runtime.sampler import SamplingParams
from duotile.runtime.stacked import stack_attr


def _masked_by_pool(self, ctx, scores, n_vis, pool_of):
    """Full score rows with the Reindex layer's rows outside each query's pool set to -inf; the
    candidate source's pool (boolean) kept per sequence by ``pool_of``."""
    cfg = self.cfg
    if self.kind == "reindex":
        pool = pool_of()
        width = scores.shape[1]
        if pool.shape[1] < width:
            pool = torch.cat([pool, pool.new_zeros(pool.shape[0], width - pool.shape[1])], 1)
        return scores.masked_fill(~pool[:, :width], float("-inf")), None
    if self.layer == cfg.candidate_source_layer_id:
        return scores, candidate_pool(scores, n_vis, cfg.candidate_block_size, cfg.candidate_topk_blocks)
    return scores, None


def _full_row_select_decode(self, ctx, seqs, qi, wts, pos):
    """The decode selection as it was: every visible row scored, the Reindex layers' rows outside the
    pool masked to -inf, one top-k over the full row."""
    stores = [seq.cache.layers[self.kv_src].index_keys for seq, _ in seqs]
    n_vis = (pos + 1) // self.ratio
    scores = index_scores(ctx, qi, wts, stack_attr(stores, stores[0].planes[0]), n_vis)
    scores, pool = _masked_by_pool(self, ctx, scores, n_vis,
                                   lambda: torch.cat([seq.scratch["full_pool"] for seq, _ in seqs]))
    if pool is not None:
        for (seq, _), row in zip(seqs, pool.split(1)):
            seq.scratch["full_pool"] = row
    sels = topk(ctx, scores, self.cfg.index_topk).split(1)
    for (seq, _), sel in zip(seqs, sels):
        seq.scratch[("topk", self.layer)] = sel
    return list(sels)


def _full_row_select(self, ctx, seqs, qi, wts, pos):
    """The prefill selection as it was: each sequence's queries score every visible row, a Reindex
    layer masks the rows outside each query's pool, one top-k for all."""
    if self.kind == "reuse":
        return [seq.scratch[("topk", self.idx_src)] for seq, _ in seqs]
    if one_token_each(seqs):
        return _full_row_select_decode(self, ctx, seqs, qi, wts, pos)
    scores = []
    for seq, sl in seqs:
        n_vis = (pos[sl] + 1) // self.ratio
        s = index_scores(ctx, qi[sl], wts[sl], seq.cache.layers[self.kv_src].index_keys.stored, n_vis)
        s, pool = _masked_by_pool(self, ctx, s, n_vis, lambda seq=seq: seq.scratch["full_pool"])
        if pool is not None:
            seq.scratch["full_pool"] = pool
        scores.append(s)
    sels = topk(ctx, pad_cat(scores, float("-inf")), self.cfg.index_topk).split([len(s) for s in scores])
    for (seq, _), sel in zip(seqs, sels):
        seq.scratch[("topk", self.layer)] = sel
    return list(sels)


def _generate(llm: LLM, max_tokens: int, prompts: list) -> list:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, return_logits=True)
    return llm.generate(prompts, [params] * len(prompts))


# prompts past the pool (3 blocks of 4 positions in tiny V4.1) beside short ones: a Reindex layer
# then scores 12 of 40-odd visible positions and picks 8 of them
PROMPTS = [list(range(3, 43)), [2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]


@pytest.mark.parametrize("invariant", [False, True])
def test_pool_scoring_gives_the_logits_of_full_row_scoring(ckpt_dir, monkeypatch, invariant):
    llm = LLM(ckpt_dir("v41-tiny"), batch_invariant=invariant)
    pooled = _generate(llm, 6, PROMPTS)
    calls = llm.last_stats.ops
    assert calls["index_scores_pool"][1] > 0 and calls["candidate_pool"][1] > 0, calls
    monkeypatch.setattr(AttentionV41, "_select", _full_row_select)
    full = _generate(llm, 6, PROMPTS)
    assert "index_scores_pool" not in llm.last_stats.ops
    for a, b in zip(pooled, full):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_greedy_tokens_on_generated_kernels_are_those_of_full_row_scoring(ckpt_dir, monkeypatch):
    """The pool's logits on ``indexer_logits_pool`` and the full rows' on ``indexer_logits``: the
    same greedy tokens (and, the interpreter's logits being those of the full row at each
    position bit for bit, the same logits)."""
    llm = LLM(ckpt_dir("v41-tiny"), kernels="generated")
    prompts = [list(range(3, 23)), [2, 7]]
    pooled = _generate(llm, 3, prompts)
    assert llm.last_stats.ops["index_scores_pool"][0] > 0 == llm.last_stats.ops["index_scores_pool"][1]
    monkeypatch.setattr(AttentionV41, "_select", _full_row_select)
    full = _generate(llm, 3, prompts)
    for a, b in zip(pooled, full):
        assert a.token_ids == b.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_pool_scores_are_the_full_rows_at_the_pools_positions():
    """The reference op: each column the full row's score at its position, -inf for an empty slot
    and past the visible count; no key rows yet: every column -inf."""
    g = torch.Generator().manual_seed(0)
    qi, wts = torch.randn(2, 4, 16, generator=g), torch.randn(2, 4, generator=g)
    keys, n_vis = torch.randn(2, 30, 16, generator=g), torch.tensor([30, 10])
    ctx = Ctx(FastOps())
    full = index_scores(ctx, qi, wts, keys, n_vis)
    blocks = torch.tensor([[1, 3, 7, -1], [0, 2, -1, -1]], dtype=torch.int32)
    got = attention_v41.index_scores_pool(ctx, qi, wts, keys, n_vis, blocks, 4)
    assert got.shape == (2, 16)
    assert torch.equal(got[0, :8], full[0, [4, 5, 6, 7, 12, 13, 14, 15]])
    assert torch.equal(got[0, 8:10], full[0, 28:30]) and bool(torch.isneginf(got[0, 10:]).all())
    assert torch.equal(got[1, :4], full[1, :4]) and torch.equal(got[1, 4:6], full[1, 8:10])
    assert bool(torch.isneginf(got[1, 6:]).all())
    empty = attention_v41.index_scores_pool(ctx, qi, wts, keys[:, :0], torch.zeros(2, dtype=torch.long), blocks, 4)
    assert empty.shape == (2, 16) and bool(torch.isneginf(empty).all())
    assert ctx.tally.snapshot()["index_scores_pool"] == (0, 2)


def test_the_pool_op_gives_the_block_list_of_its_pool():
    scores = torch.tensor([[0.0, 5, 1, 1, 2, 2, 9, 0, 0, 0]])
    pool = candidate_pool(scores, torch.tensor([9]), 2, 3)
    assert pool[0].nonzero().flatten().tolist() == [0, 1, 6, 7, 8]
    blocks = pick_pool(Ctx(FastOps()), scores, torch.tensor([9]), 2, 3)
    assert blocks.tolist() == [[0, 3, 4]] and torch.equal(blocks, pool_blocks(pool, 2, 3))


def test_pool_scores_over_shared_keys_are_each_querys_own_keys_scores():
    """A prefill chunk's queries read one sequence's keys [N, c]: the same scores as each query
    given that stack as its own."""
    g = torch.Generator().manual_seed(1)
    qi, wts, keys = torch.randn(3, 4, 16, generator=g), torch.randn(3, 4, generator=g), torch.randn(30, 16, generator=g)
    n_vis, ctx = torch.tensor([12, 13, 14]), Ctx(FastOps())
    blocks = torch.tensor([[0, 2, -1], [1, 3, -1], [0, 1, 3]], dtype=torch.int32)
    shared = attention_v41.index_scores_pool(ctx, qi, wts, keys, n_vis, blocks, 4)
    own = attention_v41.index_scores_pool(ctx, qi, wts, keys.expand(3, -1, -1), n_vis, blocks, 4)
    assert torch.equal(shared, own) and bool(torch.isneginf(shared[0, 8:]).all())
