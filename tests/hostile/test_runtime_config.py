"""Bad config values end in one ConfigError naming the field - never a traceback, garbage or an OOM."""

from __future__ import annotations

import json
import resource
import time

import pytest

from duotile.cli import main
from duotile.runtime.config import ConfigError, ModelConfig
from duotile.runtime.engine import LLM
from duotile.runtime.presets import get_preset
from duotile.runtime.weights import Checkpoint

from .runtime_support import copy_of


def _v41(**change):
    raw = get_preset("v41-tiny").to_dict()
    raw["text_config"].update(change)
    return raw


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"candidate_block_size": 0}, "candidate_block_size", "positive integer"),
    ({"rope_theta": 0}, "rope_theta", "> 1"),
    ({"rope_theta": "10000"}, "rope_theta", "finite number"),
    ({"compress_rope_theta": -5.0}, "compress_rope_theta", "> 1"),
    ({"swiglu_limit": "none"}, "swiglu_limit", "finite number"),
    ({"swiglu_limit": 0}, "swiglu_limit", "> 0"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps", "(0, 1)"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps", "(0, 1)"),
    ({"hc_eps": -1e-6}, "hc_eps", "[0, 1)"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor", "finite"),
    ({"routed_scaling_factor": float("inf")}, "routed_scaling_factor", "finite"),
    ({"hidden_size": True}, "hidden_size", "positive integer"),
    ({"hidden_size": 256.0}, "hidden_size", "positive integer"),
    ({"index_topk": 10**9}, "index_topk", "max_position_embeddings"),
    ({"candidate_topk_blocks": 10**6}, "candidate_topk_blocks", "max_position_embeddings"),
    ({"engram_layer_ids": ["1"]}, "engram_layer_ids", "non-negative integers"),
    ({"rope_scaling": {"type": "yarn", "factor": "x"}}, "rope_scaling.factor", "finite number"),
    ({"rope_scaling": [1, 2]}, "rope_scaling", "JSON object"),
    ({"norm_topk_prob": 1}, "norm_topk_prob", "true or false"),
])
def test_bad_value_is_a_config_error_naming_the_field(change, field, words):
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(_v41(**change))
    assert str(err.value).startswith(field + ":") and words in str(err.value)


def test_missing_or_malformed_text_config():
    raw = get_preset("v41-tiny").to_dict()
    del raw["text_config"]
    with pytest.raises(ConfigError, match=r"^text_config: missing"):
        ModelConfig.from_dict(raw)
    raw["text_config"] = "tiny"
    with pytest.raises(ConfigError, match=r"^text_config: expected a JSON object"):
        ModelConfig.from_dict(raw)


def test_json_integers_for_float_fields_are_accepted_as_floats():
    cfg = ModelConfig.from_dict(_v41(rope_theta=10000, swiglu_limit=10))
    assert cfg.rope_theta == 10000.0 and isinstance(cfg.rope_theta, float) and isinstance(cfg.swiglu_limit, float)


def test_replace_is_checked_too():
    with pytest.raises(ConfigError, match=r"^hc_eps:"):
        get_preset("v4-tiny").replace(hc_eps=-1.0)


def _with_config(tmp_path, **change):
    path = copy_of("v41-tiny", tmp_path / "c")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"].update(change)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_absurd_index_topk_is_refused_before_allocating(tmp_path):
    """index_topk = 10**6 passes the per-field rules but implies hundreds of GiB per step: refused by name."""
    path = _with_config(tmp_path, index_topk=10**6)
    before, start = _max_rss_bytes(), time.perf_counter()
    with pytest.raises(ConfigError) as err:
        LLM(str(path))
    assert str(err.value).startswith("index_topk:") and "GiB" in str(err.value) and "available" in str(err.value)
    assert _max_rss_bytes() - before < 1 << 30 and time.perf_counter() - start < 60


def test_a_million_experts_is_refused_before_the_inventory_is_listed(tmp_path):
    path = _with_config(tmp_path, n_routed_experts=10**6)
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^n_routed_experts: the config implies \d+ checkpoint tensors"):
        Checkpoint.open(path)
    assert time.perf_counter() - start < 30


def test_generate_on_a_bad_config_is_one_line_and_exit_2(tmp_path, capsys):
    path = _with_config(tmp_path, rope_theta="ten thousand")
    assert main(["generate", "--model", str(path), "--prompt-ids", "1", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rope_theta: expected a finite number" in err
