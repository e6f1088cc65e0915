"""V4.1's Reindex layers at decode score only the candidate pool's positions (``index_scores_pool``)
where they scored every visible row and masked the rest with the pool: the rows they select, and
so a generation's logits, are the same bit for bit on the reference ops, and its greedy tokens on
generated kernels."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.engine import LLM
from duotile.runtime.layers import attention_v41
from duotile.runtime.layers.attention_v41 import AttentionV41, pick_pool, pool_blocks
from duotile.runtime.layers.common import Ctx, index_scores, topk
from duotile.runtime.ops import FastOps
from duotile.runtime.sampler import SamplingParams
from duotile.runtime.stacked import stack_attr


def _full_row_select_decode(self, ctx, seqs, qi, wts, pos):
    """The decode selection as it was: every visible row scored, the Reindex layers' rows outside the
    pool masked to -inf, one top-k over the full row."""
    cfg, stores = self.cfg, [seq.cache.layers[self.kv_src].index_keys for seq, _ in seqs]
    keys = stack_attr(stores, stores[0].planes[0])
    n_vis = (pos + 1) // self.ratio
    scores = index_scores(ctx, qi, wts, keys, n_vis)
    if self.kind == "reindex":
        pool = torch.cat([seq.scratch["pool"] for seq, _ in seqs])
        width = scores.shape[1]
        if pool.shape[1] < width:
            pool = torch.cat([pool, pool.new_zeros(pool.shape[0], width - pool.shape[1])], 1)
        scores = scores.masked_fill(~pool[:, :width], float("-inf"))
    elif self.layer == cfg.candidate_source_layer_id:
        pool, _ = pick_pool(ctx, scores, n_vis, cfg.candidate_block_size, cfg.candidate_topk_blocks)
        for (seq, _), row in zip(seqs, pool.split(1)):
            seq.scratch["pool"] = row
    sels = topk(ctx, scores, cfg.index_topk).split(1)
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
    monkeypatch.setattr(AttentionV41, "_select_decode", _full_row_select_decode)
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
    monkeypatch.setattr(AttentionV41, "_select_decode", _full_row_select_decode)
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
    pool, blocks = pick_pool(Ctx(FastOps()), scores, torch.tensor([9]), 2, 3)
    assert pool[0].nonzero().flatten().tolist() == [0, 1, 6, 7, 8]
    assert blocks.tolist() == [[0, 3, 4]] and torch.equal(blocks, pool_blocks(pool, 2, 3))
