"""Config parsing, presets, derived layer schedule and error messages."""

from __future__ import annotations

import json

import pytest

from duotile.runtime.config import ConfigError, ModelConfig
from duotile.runtime.presets import PRESETS, get_preset


def test_v4_flash_schedule_matches_model_md():
    cfg = get_preset("v4-flash")
    assert cfg.model_type == "deepseek_v4" and not cfg.is_v41
    kinds = [cfg.attention_kind(layer) for layer in range(cfg.num_hidden_layers)]
    assert kinds[:2] == ["swa", "swa"]
    assert all(kinds[layer] == "csa" for layer in range(2, 43, 2))
    assert all(kinds[layer] == "hca" for layer in range(3, 42, 2))
    assert len(cfg.compress_ratios) == 44 and cfg.compress_ratios[-1] == 0
    assert [cfg.is_hash_layer(layer) for layer in range(4)] == [True, True, True, False]
    assert cfg.weight_block_size == (128, 128) and cfg.rms_norm_eps == 1e-6


def test_v41_flash_roles_match_model_md():
    cfg = get_preset("v41-flash")
    roles = {layer: cfg.attention_kind(layer) for layer in range(cfg.num_hidden_layers)}
    assert roles[0] == roles[1] == "swa"
    assert [layer for layer, r in roles.items() if r == "full"] == [2, 8, 14, 20]
    assert [layer for layer, r in roles.items() if r == "reindex"] == [24, 28, 32, 36]
    assert roles[3] == roles[19] == roles[21] == roles[39] == "reuse"
    assert cfg.kv_source(27) == 20 and cfg.index_source(27) == 24 and cfg.index_source(13) == 8
    assert cfg.weight_block_size == (32, 32) and cfg.rms_norm_eps == 1e-20 and cfg.num_hash_layers == 0


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_config_json(name, tmp_path):
    cfg = get_preset(name)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    again = ModelConfig.from_file(tmp_path / "config.json")
    assert again == cfg


def test_tiny_presets_exercise_every_path():
    v4 = get_preset("v4-tiny")
    assert {v4.attention_kind(layer) for layer in range(v4.num_hidden_layers)} == {"swa", "csa", "hca"}
    assert v4.num_hash_layers == 2 and v4.num_nextn_predict_layers == 1
    v41 = get_preset("v41-tiny")
    kinds = {v41.attention_kind(layer) for layer in range(v41.num_hidden_layers)}
    assert kinds == {"swa", "full", "reindex", "reuse"}
    assert {v41.ratio(s) for s in v41.kv_source_layer_ids} == {1, 2}
    assert v41.candidate_source_layer_id in v41.kv_source_layer_ids and len(v41.engram_layer_ids) == 2


def test_hf_style_v4_config_with_layer_types():
    """transformers' DeepseekV4Config spelling: layer_types + compress_rates, nested rope_parameters."""
    raw = get_preset("v4-tiny").to_dict()
    del raw["compress_ratios"]
    raw["layer_types"] = ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                          "heavily_compressed_attention"] * 1 + ["compressed_sparse_attention",
                                                                 "heavily_compressed_attention"]
    raw["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}
    raw["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": 10000.0},
                              "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                                           "original_max_position_embeddings": 65536, "beta_fast": 32,
                                           "beta_slow": 1}}
    del raw["rope_scaling"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.compress_ratios == get_preset("v4-tiny").compress_ratios


@pytest.mark.parametrize(("change", "field"), [
    ({"model_type": "llama"}, "model_type"),
    ({"hidden_size": -4}, "hidden_size"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"compress_ratios": [0, 0, 4]}, "compress_ratios"),
    ({"compress_ratios": [0, 0, 3, 16, 4, 16, 0]}, "compress_ratios"),
    ({"o_groups": 3}, "o_groups"),
    ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"some_new_knob": 1}, "some_new_knob"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type"),
])
def test_bad_v4_values_name_the_field(change, field):
    raw = {**get_preset("v4-tiny").to_dict(), **change}
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value).startswith(field + ":")


@pytest.mark.parametrize(("change", "field"), [
    ({"compress_ratios": [0, 0, 2, 1, 2, 1, 1, 1, 1, 1, 0]}, "compress_ratios"),  # layer 3 vs its source 2
    ({"kv_source_layer_ids": [2, 2, 4, 5]}, "kv_source_layer_ids"),
    ({"kv_source_layer_ids": [2, 5]}, "candidate_source_layer_id"),  # layer 4 becomes a Reindex layer
    ({"index_source_layer_ids": [2, 5, 7, 9]}, "index_source_layer_ids"),
    ({"candidate_source_layer_id": 3}, "candidate_source_layer_id"),
    ({"engram_num_embeddings": [10]}, "engram_num_embeddings"),
    ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 4, 0]}, "compress_ratios"),
])
def test_inconsistent_v41_values_name_the_field(change, field):
    raw = get_preset("v41-tiny").to_dict()
    raw["text_config"].update(change)
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(raw)
    assert str(err.value).startswith(field + ":")


def test_unknown_preset_and_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="preset"):
        get_preset("v5-huge")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        ModelConfig.from_file(tmp_path / "config.json")
