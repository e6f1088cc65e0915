"""A released model on N of its layers (`runtime/layer_subset.py`): a valid config of the same
family, real widths and expert counts, the full model's layer kinds, every layer id renumbered."""

from __future__ import annotations

import math

import pytest
import torch

from duotile.runtime.config import ConfigError
from duotile.runtime.inventory import tensor_specs
from duotile.runtime.layer_subset import ENGRAM_ROWS, layer_kind, layer_subset
from duotile.runtime.presets import get_preset, preset_notes, written_preset


@pytest.mark.parametrize("model", ["v4-flash", "v41-flash"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 12, 40])
def test_each_kept_layer_keeps_its_kind_and_its_sources(model, n):
    full = get_preset(model)
    sub = layer_subset(full, n)
    cfg, src = sub.config, sub.sources
    assert cfg.num_hidden_layers == n and list(src) == sorted(set(src))
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size) == \
        (full.hidden_size, full.n_routed_experts, full.moe_intermediate_size)
    assert [layer_kind(cfg, i) for i in range(n)] == [layer_kind(full, s) for s in src] == list(sub.kinds)
    assert cfg.compress_ratios[n:] == full.compress_ratios[full.num_hidden_layers:]
    if not full.is_v41:
        assert [cfg.is_hash_layer(i) for i in range(n)] == [full.is_hash_layer(s) for s in src]
        return
    for i, s in enumerate(src):
        if cfg.ratio(i):  # the full model's KV source of the layer is kept, and is its source here
            assert src[cfg.kv_source(i)] == full.kv_source(s)
    if "reindex/ratio1" in sub.kinds:
        assert src[cfg.candidate_source_layer_id] == full.candidate_source_layer_id


@pytest.mark.parametrize(("model", "n"), [("v4-flash", 4), ("v41-flash", 8)])
def test_few_layers_hold_every_kind_of_the_full_model(model, n):
    full = get_preset(model)
    kinds = {layer_kind(full, layer) for layer in range(full.num_hidden_layers)}
    assert len(kinds) == n and set(layer_subset(full, n).kinds) == kinds
    assert len(set(layer_subset(full, n - 1).kinds)) == n - 1


def test_engram_tables_shrink_and_the_notes_say_so():
    sub = layer_subset(get_preset("v41-flash"), 4)
    cfg = sub.config
    assert cfg.engram_layer_ids == (0,) and all(rows <= ENGRAM_ROWS for rows in cfg.engram_num_embeddings)
    assert any("384,006,168" in note and "engram" in note for note in sub.notes)
    assert cfg.engram_compressed_vocab_size == cfg.vocab_size
    assert preset_notes("v41-flash-L4") == sub.notes and preset_notes("v41-tiny") == ()


def test_layer_subset_presets_by_name():
    assert get_preset("v41-flash-L4") == layer_subset(get_preset("v41-flash"), 4).config
    assert written_preset("v4-flash-L2") and written_preset("v41-tiny") and not written_preset("v41-flash")
    with pytest.raises(ConfigError, match="layers: 41 is not between 1 and the model's 40 layers"):
        get_preset("v41-flash-L41")
    with pytest.raises(ConfigError, match=r"unknown name 'v5-flash-L4'.*v41-flash-L4"):
        get_preset("v5-flash-L4")


def test_a_four_layer_checkpoint_of_the_real_dimensions_is_planned_without_drawing():
    """What `--layers 4` writes, from the tensors' sizes: V4.1's experts dominate (7 GB a layer)."""
    from duotile.runtime.weights import shard_plan

    cfg = get_preset("v41-flash-L4")
    sizes = {n: math.prod(shape) * dtype.itemsize for s in tensor_specs(cfg)
             for n, (shape, dtype) in s.stored(cfg.weight_block_size[0]).items()}
    assert 20e9 < sum(sizes.values()) < 45e9
    assert sum(len(shard) for shard in shard_plan(cfg, 4 << 30)) == len(sizes)
    assert torch.float8_e4m3fn in {d for s in tensor_specs(cfg) for _, d in s.stored(32).values()}


def test_generate_layers_needs_a_released_model(capsys):
    from duotile.cli import main

    assert main(["generate", "--model", "v41-tiny", "--layers", "2", "--prompt-ids", "1"]) != 0
    assert "--layers needs a released model" in capsys.readouterr().err
