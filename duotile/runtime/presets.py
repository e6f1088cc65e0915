"""Built-in configurations: the two released models and the tiny test models.

* `v4-flash`, `v41-flash`: the released DeepSeek-V4-Flash / V4.1-Flash text configs (model.md 1.1, 1.7).
* `v4-tiny`: model.md 6.4 with the synthetic 1024-token vocabulary - every V4 path (SWA, overlapping
  ratio-4 CSA with indexer, HCA at ratio 16, hash and score routing, MTP weights) at hidden 256.
* `v41-tiny`: the V4.1 equivalent - SWA, ratio-2 Full and Reuse layers, a ratio-1 Full layer that is
  the candidate source, Reuse and Reindex layers after it, Engram at two layers, one DSpark block.
  Its quantisation granularities are the real ones (32x32 weight blocks, FP8/32 window KV, NVFP4/16
  compressed KV, MXFP4/32 index keys).

* `v4-flash-L4`, `v41-flash-L8` (any N): a released model on N of its layers, real widths and expert
  counts, every kind of layer N allows (`layer_subset.py`); like the tiny models, its random checkpoint
  is written on first use.

`get_preset(name)` returns a fresh validated `ModelConfig`; `DEFAULT_PRESET` is the embedded model the
CLI and `LLM()` use when no model is given.
"""

from __future__ import annotations

import re

from .config import ConfigError, ModelConfig

DEFAULT_PRESET = "v41-tiny"


def _v4_flash() -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
        "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
        "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512, "n_routed_experts": 256, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
        "num_hash_layers": 3, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "pad_token_id": None,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
        "expert_dtype": "fp4",
    })


def _v41_flash() -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "deepseek_v41", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                "expert_dtype": "fp4"},
        "text_config": {
            "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
            "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
            "rms_norm_eps": 1e-20, "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
            "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
            "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
            "candidate_topk_blocks": 2048, "candidate_block_size": 8, "n_routed_experts": 384,
            "num_experts_per_tok": 6, "moe_intermediate_size": 2304, "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_n_heads": 8,
            "engram_head_dim": 256, "engram_vocab_size": 16000000, "engram_compressed_vocab_size": 99092,
            "engram_pad_token_id": 2, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
            "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
            "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
        },
    })


def _v4_tiny() -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "deepseek_v4", "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 6,
        "compress_ratios": [0, 0, 4, 16, 4, 16, 0], "num_attention_heads": 4, "head_dim": 128,
        "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128, "sliding_window": 16,
        "index_n_heads": 4, "index_head_dim": 128, "index_topk": 8, "n_routed_experts": 16,
        "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 256, "num_hash_layers": 2,
        "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1, "pad_token_id": None,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
        "expert_dtype": "fp4",
    })


def _v41_tiny() -> ModelConfig:
    from .layers.engram import engram_table_rows

    text = {
        "vocab_size": 1024, "hidden_size": 256, "num_hidden_layers": 10, "num_attention_heads": 4,
        "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
        "rms_norm_eps": 1e-20, "sliding_window": 16, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0],
        "kv_source_layer_ids": [2, 4, 5], "index_source_layer_ids": [2, 4, 5, 7, 9], "index_n_heads": 2,
        "index_head_dim": 128, "index_topk": 8, "candidate_source_layer_id": 5, "candidate_topk_blocks": 3,
        "candidate_block_size": 4, "n_routed_experts": 16, "num_experts_per_tok": 6,
        "moe_intermediate_size": 256, "engram_layer_ids": [1, 4], "engram_max_ngram_size": 4,
        "engram_n_heads": 2, "engram_head_dim": 32, "engram_vocab_size": 1000,
        "engram_compressed_vocab_size": 1024, "engram_pad_token_id": 2, "num_nextn_predict_layers": 1,
        "dspark_block_size": 4, "dspark_noise_token_id": 1000, "dspark_target_layer_ids": [7, 8, 9],
        "dspark_markov_rank": 16, "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
    }
    text["engram_num_embeddings"] = engram_table_rows(text["engram_layer_ids"], text["engram_max_ngram_size"],
                                                      text["engram_n_heads"], text["engram_vocab_size"])
    return ModelConfig.from_dict({
        "model_type": "deepseek_v41", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                "expert_dtype": "fp4"},
        "text_config": text,
    })


PRESETS = {"v4-flash": _v4_flash, "v41-flash": _v41_flash, "v4-tiny": _v4_tiny, "v41-tiny": _v41_tiny}
TINY_PRESETS = ("v4-tiny", "v41-tiny")


SUBSET = re.compile(r"^(v4-flash|v41-flash)-L(\d+)$")  # a released model on N of its layers


def _subset(name: str):
    """The ``LayerSubset`` a name like ``v41-flash-L4`` stands for, else None."""
    match = SUBSET.match(name)
    if not match:
        return None
    from .layer_subset import layer_subset

    return layer_subset(PRESETS[match[1]](), int(match[2]))


def get_preset(name: str) -> ModelConfig:
    """A preset's config: a tiny model, a released one, or a released one on N layers (``v41-flash-L4``:
    ``runtime/layer_subset.py``)."""
    subset = _subset(name)
    if subset is not None:
        return subset.config
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"preset: unknown name {name!r}; known: {sorted(PRESETS)}, or a released one on N "
                          f"layers (v41-flash-L4)") from None


def written_preset(name: str) -> bool:
    """Whether a preset's checkpoint is written by the library on first use (random weights): the tiny
    models and the released ones on N layers."""
    return name in TINY_PRESETS or SUBSET.match(name) is not None


def preset_notes(name: str) -> tuple[str, ...]:
    """What a preset changes from the model it stands for (a layer subset's notes), for the output."""
    subset = _subset(name)
    return subset.notes if subset is not None else ()
