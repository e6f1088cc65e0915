"""Type and range rules for every numeric config field; `check_field` returns an error message or None.

A config value of the wrong type (a string where a number belongs, a bool where an integer belongs,
NaN or infinity) or outside the range the model's math is defined for is refused here, before any
tensor is sized from it, so a bad value ends in one `ConfigError` naming the field instead of a
traceback or garbage logits. `config.py` raises; this module only decides.
"""

from __future__ import annotations

import math
from typing import Any

INT_MAX = 2**31 - 1  # sizes beyond int32 indexing are never a real config

_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "original_max_position_embeddings",
    "max_position_embeddings", "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
    "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters", "candidate_topk_blocks",
    "candidate_block_size", "engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
    "engram_compressed_vocab_size", "dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts",
    "dspark_num_experts_per_tok",
)
_NON_NEGATIVE_INTS = ("n_shared_experts", "num_hash_layers", "num_nextn_predict_layers", "bos_token_id",
                      "eos_token_id", "engram_pad_token_id", "dspark_noise_token_id")
_INT_LISTS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
              "dspark_target_layer_ids")

# name -> (low, high, low inclusive, what the range means)
_FLOATS: dict[str, tuple[float, float, bool, str]] = {
    "rope_theta": (1.0, math.inf, False, "a rope base must be > 1"),
    "compress_rope_theta": (1.0, math.inf, False, "a rope base must be > 1"),
    "rope_factor": (1.0, math.inf, True, "the YaRN factor must be >= 1"),
    "beta_fast": (0.0, math.inf, False, "must be > 0"),
    "beta_slow": (0.0, math.inf, False, "must be > 0"),
    "routed_scaling_factor": (0.0, math.inf, False, "must be > 0"),
    "swiglu_limit": (0.0, math.inf, False, "the SwiGLU clamp must be > 0"),
    "hc_eps": (0.0, 1.0, True, "must be in [0, 1)"),
    "rms_norm_eps": (0.0, 1.0, False, "must be in (0, 1): 0 divides an all-zero row by zero"),
}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_field(name: str, value: Any) -> str | None:
    """The error message for a bad value of a config field, or None if it is fine (or not checked here)."""
    if name in _POSITIVE_INTS:
        if not is_int(value) or not 0 < value <= INT_MAX:
            return f"expected a positive integer (at most {INT_MAX}), got {value!r}"
    elif name in _NON_NEGATIVE_INTS:
        if not is_int(value) or not 0 <= value <= INT_MAX:
            return f"expected a non-negative integer, got {value!r}"
    elif name == "pad_token_id":
        if value is not None and (not is_int(value) or not 0 <= value <= INT_MAX):
            return f"expected null or a non-negative integer, got {value!r}"
    elif name == "candidate_source_layer_id":
        if not is_int(value) or not -1 <= value <= INT_MAX:
            return f"expected a layer id or -1 (none), got {value!r}"
    elif name in _FLOATS:
        low, high, inclusive, meaning = _FLOATS[name]
        if not is_number(value) or not math.isfinite(value):
            return f"expected a finite number, got {value!r}"
        if not ((value >= low if inclusive else value > low) and value < high):
            return f"{meaning}, got {value!r}"
    elif name in _INT_LISTS:
        if not isinstance(value, (list, tuple)) or not all(is_int(v) and 0 <= v <= INT_MAX for v in value):
            return f"expected a list of non-negative integers, got {value!r}"
    elif name == "engram_num_embeddings":
        if not isinstance(value, (list, tuple)) or not all(is_int(v) and 0 < v <= 2**40 for v in value):
            return f"expected a list of positive integers, got {value!r}"
    elif name == "norm_topk_prob":
        if not isinstance(value, bool):
            return f"expected true or false, got {value!r}"
    elif name in ("model_type", "scoring_func", "topk_method", "expert_dtype"):
        if not isinstance(value, str):
            return f"expected a string, got {value!r}"
    return None


def float_fields() -> tuple[str, ...]:
    return tuple(_FLOATS)
