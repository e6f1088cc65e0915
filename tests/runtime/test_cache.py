"""Decode state per layer kind and the byte counts of model.md section 3."""

from __future__ import annotations

import torch

from duotile.runtime.cache import (
    format_bytes,
    mxfp4_row_bytes,
    v4_kv_row_bytes,
    v41_comp_row_bytes,
    v41_window_row_bytes,
)
from duotile.runtime.engine import LLM
from duotile.runtime.layers.step import StepSeq
from duotile.runtime.presets import get_preset
from duotile.runtime.sampler import SamplingParams

from .conftest import tokens


def test_v4_flash_byte_counts_match_model_md():
    cfg = get_preset("v4-flash")
    assert v4_kv_row_bytes(cfg) == 584 and mxfp4_row_bytes(cfg.index_head_dim) == 68
    n = 131072
    grow = format_bytes(cfg, n)
    assert (grow.compressed + grow.index_keys) / n == 3514.25
    fixed = format_bytes(cfg, 0, include_nextn=True)
    assert fixed.window == 44 * 128 * 584  # 3.29 MB of window rings, MTP layer included
    assert fixed.compressor_state == 21 * (64 + 16) * 1024 + 20 * 512 * 1024  # ~11.6 MiB
    assert 0.42 < (grow.compressed + grow.index_keys) / 2**30 < 0.44  # 0.43 GiB at 128K


def test_v41_flash_byte_counts_match_model_md():
    cfg = get_preset("v41-flash")
    assert (v41_window_row_bytes(cfg), v41_comp_row_bytes(cfg), mxfp4_row_bytes(cfg.index_head_dim)) == (528, 288, 68)
    n = 1 << 20
    b = format_bytes(cfg, n)
    assert (b.compressed + b.index_keys) / n == 890
    assert b.window == 40 * 128 * 528
    assert b.compressor_state == 3 * 2 * 512 * 2 * 4 and b.engram_history == 24


def test_v4_cache_holds_the_state_of_every_layer_kind(build):
    model = build("v4-tiny")
    cfg, cache, n = model.config, model.new_cache(), 37
    model.forward([StepSeq(cache, tokens(n, cfg.vocab_size, seed=3))])
    assert cache.num_tokens == n
    for layer, lc in enumerate(cache.layers):
        m = cfg.ratio(layer)
        assert lc.ring.shape == (cfg.sliding_window, cfg.head_dim)
        if m == 0:
            assert lc.comp is None and lc.comp_state is None
            continue
        assert lc.comp.n == n // m and lc.comp_state.pending_c.shape[0] == n % m
        if m == 4:
            assert lc.index_keys.n == n // 4 and lc.index_state.pending_z.shape[0] == n % 4
            assert lc.comp_state.prev_c.shape == (4, cfg.head_dim)  # A halves of the last complete window
        else:
            assert lc.index_keys is None and lc.comp_state.prev_c is None


def test_v41_cache_holds_shared_kv_only_on_sources(build):
    model = build("v41-tiny")
    cfg, cache, n = model.config, model.new_cache(), 23
    seq = tokens(n, cfg.vocab_size, seed=4)
    model.forward([StepSeq(cache, seq)])
    for layer, lc in enumerate(cache.layers):
        if layer in cfg.kv_source_layer_ids:
            m = cfg.ratio(layer)
            assert lc.comp.n == lc.index_keys.n == n // m
            assert (lc.comp_state is None) == (m == 1)
        else:
            assert lc.comp is None and lc.index_keys is None
    assert cache.engram_history == seq[-3:].tolist()


def test_engine_reports_cache_bytes(ckpt_dir):
    llm = LLM(ckpt_dir("v41-tiny"))
    out = llm.generate([3, 1, 4, 1, 5], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    total = 5 + 12 - 1  # the last sampled token is not yet in the cache
    assert out.cache_bytes == format_bytes(llm.config, total)
    assert out.allocated_cache_bytes > 0 and llm.last_stats.cache_bytes == out.cache_bytes.total
    assert llm.last_stats.tokens_per_second > 0 and torch.is_tensor(torch.tensor(out.token_ids))
