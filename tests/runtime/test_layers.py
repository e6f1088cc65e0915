"""Unit checks of the building blocks against direct transcriptions of model.md formulas."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.cache import CompressorState
from duotile.runtime.layers.attention_v41 import candidate_pool
from duotile.runtime.layers.common import Ctx, Rotary, select_topk
from duotile.runtime.layers.compressor import pool_windows
from duotile.runtime.layers.engram import Engram, engram_primes, hash_multipliers
from duotile.runtime.layers.mhc import HCSite
from duotile.runtime.ops import FastOps, InvariantOps
from duotile.runtime.presets import get_preset

CTX = Ctx(FastOps(), torch.float32, quant=False)


def test_select_topk_ties_padding_and_order():
    scores = torch.tensor([[1.0, 3.0, 3.0, -float("inf"), 2.0], [-float("inf")] * 5])
    assert select_topk(scores, 3).tolist() == [[1, 2, 4], [-1, -1, -1]]
    assert select_topk(scores[:, :2], 4).tolist() == [[0, 1, -1, -1], [-1, -1, -1, -1]]


def test_yarn_frequencies_match_model_md():
    rope = Rotary(get_preset("v4-flash"), compressed=True)
    base = torch.tensor([160000.0 ** (-2 * i / 64) for i in range(32)])
    assert torch.allclose(rope.freqs[:15], base[:15]) and torch.allclose(rope.freqs[25:], base[25:] / 16)
    assert abs(rope.freqs[20].item() - 2.97e-4) < 1e-6 and abs(base[20].item() - 5.59e-4) < 1e-6
    plain = Rotary(get_preset("v4-flash"), compressed=False)
    assert torch.allclose(plain.freqs, torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)]))
    x = torch.randn(3, 2, 128, generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([0, 5, 70000])
    back = plain.apply(plain.apply(x, pos), pos, inverse=True)
    assert torch.allclose(back, x, atol=1e-5) and torch.equal(plain.apply(x, pos)[..., :64], x[..., :64])


def _direct_csa(c, z, ratio):
    """model.md 2.5.4: row w pools A halves of window w-1 and B halves of window w, per channel."""
    half, rows = c.shape[1] // 2, []
    for w in range(c.shape[0] // ratio):
        cur = slice(w * ratio, (w + 1) * ratio)
        vals, scs = [c[cur, half:]], [z[cur, half:]]
        if w:
            prev = slice((w - 1) * ratio, w * ratio)
            vals.insert(0, c[prev, :half])
            scs.insert(0, z[prev, :half])
        v, s = torch.cat(vals), torch.cat(scs)
        rows.append((torch.softmax(s, 0) * v).sum(0))
    return torch.stack(rows)


@pytest.mark.parametrize("ops", [FastOps(), InvariantOps()])
def test_overlapping_pooling_any_chunking(ops):
    ctx = Ctx(ops, torch.float32, quant=False)
    g = torch.Generator().manual_seed(1)
    c, z = torch.randn(23, 16, generator=g), torch.randn(23, 16, generator=g)
    want = _direct_csa(c, z, 4)
    st, got, at = CompressorState.empty(16, "cpu"), [], 0
    for size in (3, 1, 6, 13):
        rows, first = pool_windows(ctx, st, c[at : at + size], z[at : at + size], at, 4, overlap=True)
        assert first == at // 4  # the first window this chunk can complete
        got.append(rows)
        at += size
    torch.testing.assert_close(torch.cat(got), want)
    assert st.pending_c.shape[0] == 23 % 4


def test_non_overlapping_pooling():
    g = torch.Generator().manual_seed(2)
    c, z = torch.randn(35, 8, generator=g), torch.randn(35, 8, generator=g)
    st = CompressorState.empty(8, "cpu")
    rows, first = pool_windows(CTX, st, c, z, 0, 16, overlap=False)
    win = [slice(w * 16, (w + 1) * 16) for w in range(2)]
    want = torch.stack([(torch.softmax(z[s], 0) * c[s]).sum(0) for s in win])
    torch.testing.assert_close(rows, want)
    assert first == 0 and st.pending_c.shape[0] == 3


def test_candidate_pool_keeps_newest_block_and_top_blocks():
    scores = torch.tensor([[5.0, 0.0, 0.0, 0.0, 1.0, 1.0, 9.0, 0.0, 2.0, -float("inf")]])
    pool = candidate_pool(scores, torch.tensor([9]), block=2, topk_blocks=2)
    # blocks (max): [5, 0, 1, 9, 2]; newest visible position 8 -> block 4 forced; then block 3 (9)
    assert pool.nonzero()[:, 1].tolist() == [6, 7, 8]
    pool = candidate_pool(scores, torch.tensor([9]), block=2, topk_blocks=3)
    assert pool.nonzero()[:, 1].tolist() == [0, 1, 6, 7, 8]


def test_sinkhorn_is_nearly_doubly_stochastic():
    cfg = get_preset("v4-tiny")
    site = HCSite(cfg, torch.zeros(24, 1024), torch.zeros(24), torch.ones(3))
    comb = site.sinkhorn(CTX, torch.randn(5, 4, 4, generator=torch.Generator().manual_seed(0)) * 3)
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-5, rtol=0)  # columns: last step
    torch.testing.assert_close(comb.sum(-1), torch.ones(5, 4), atol=2e-2, rtol=0)  # rows: 20 iterations


def test_engram_hash_matches_the_formula(build):
    cfg = get_preset("v41-tiny")
    primes = engram_primes(cfg.engram_layer_ids, 4, cfg.engram_n_heads, cfg.engram_vocab_size)
    flat = [p for layer in primes for p in layer]
    assert flat == sorted(set(flat)) and flat[0] == 1009 and len(flat) == 12
    assert list(cfg.engram_num_embeddings) == [sum(layer) for layer in primes]
    engram = build("v41-tiny").blocks[4].engram
    mult = hash_multipliers(4, 4, cfg.engram_compressed_vocab_size)
    assert all(m % 2 == 1 for m in mult)
    toks = [5, 900, 17, 3, 1023]

    def wrap(v):
        return (v + 2**63) % 2**64 - 2**63

    ids = engram.hash_ids([], torch.tensor(toks))
    for t in range(len(toks)):
        hist = [2] * 3 + toks
        h = wrap(hist[t + 3] * mult[0])
        for order in range(1, 4):
            h = wrap(h ^ wrap(hist[t + 3 - order] * mult[order]))
            for head in range(cfg.engram_n_heads):
                p = primes[1][(order - 1) * cfg.engram_n_heads + head]
                offset = sum(primes[1][: (order - 1) * cfg.engram_n_heads + head])
                assert ids[t, (order - 1) * cfg.engram_n_heads + head].item() == h % p + offset
    assert torch.equal(engram.hash_ids(toks[:2], torch.tensor(toks[2:])), ids[2:])
    assert isinstance(engram, Engram)


@pytest.mark.parametrize("start, s", [(0, 5), (3, 4), (40, 6), (10, 20)])
def test_window_rows_name_each_querys_window_once_in_position_order(start, s):
    """A chunk's window rows are the ring's W - 1 rows before it and its own S rows, each once;
    query i (position start + i) names the W of them at positions start + i - W + 1 .. start + i,
    -1 before position 0 (a ring that wrapped, a chunk longer than the window)."""
    from duotile.runtime.layers.cache_rows import window_rows

    w, d = 16, 8
    ring = torch.zeros(w, d)
    for p in range(max(0, start - w), start):  # row of position p holds p in every channel
        ring[p % w] = p
    new = torch.arange(start, start + s, dtype=torch.float32)[:, None].expand(s, d)
    rows, idx = window_rows(ring, start, new)
    assert rows.shape == (w - 1 + s, d) and idx.shape == (s, w)
    for i in range(s):
        for j in range(w):
            pos = start + i - w + 1 + j
            assert (idx[i, j] == -1) if pos < 0 else (rows[idx[i, j], 0] == pos)


@pytest.mark.parametrize("name, fmt", [("v41-tiny", "nvfp4"), ("v4-tiny", "fp8_nope")])
def test_a_prefill_chunk_reads_its_rows_once_not_once_a_query(ckpt_dir, name, fmt):
    """The chunk's attention op gets each sequence's rows once (window rows + compressed rows) and
    an index list a query, where it was given a [S, L, d] copy of every query's rows."""
    from duotile.runtime.engine import LLM
    from duotile.runtime.sampler import SamplingParams
    from duotile.runtime.stored import row_bytes

    llm = LLM(ckpt_dir(name), kernels="generated")
    ops, seen = llm.model.ctx.ops, []
    served = ops._serves["sparse_attention_rows"]

    stored = []

    def watch(ctx, q, rows, idx, sink, scale, rotary=None, positions=None, cmp=None, window=None, fmt=None):
        seen.append((q.shape[0], rows.shape[0], idx.shape))
        if cmp is not None:
            stored.append((cmp.dtype, cmp.shape[1], window, fmt))
        return served(ctx, q, rows, idx, sink, scale, rotary, positions, cmp, window, fmt)

    ops._serves["sparse_attention_rows"] = watch
    llm.generate([list(range(3, 33))], [SamplingParams(max_tokens=1, ignore_eos=True)])
    w, d = llm.config.sliding_window, llm.config.head_dim
    assert seen and all(t == 30 and w - 1 + t <= n <= w - 1 + t + 30 and shape[0] == t for t, n, shape in seen)
    assert max(shape[1] for *_, shape in seen) > w  # the compressed rows' slots after the window's
    # the compressed rows reach the op as stored (V4.1's NVFP4-like bytes, V4's FP8-nope), not decoded first
    assert stored and set(stored) == {(torch.uint8, row_bytes(d, fmt), w, fmt)}
