"""Model configuration for DeepSeek-V4-Flash (`deepseek_v4`) and V4.1-Flash (`deepseek_v41`).

`ModelConfig.from_dict` reads a checkpoint's `config.json` (HF layout: V4 flat, V4.1 with a nested
`text_config`), normalises the several spellings the released configs use (`compress_ratios` or
`layer_types` + `compress_rates`, `rope_scaling` or `rope_parameters`, `num_hash_layers` or
`mlp_layer_types`) and checks every value. A bad value raises `ConfigError` naming the field.
The layer schedule (model.md 1.2 and the V4.1 role table of 1.7) is derived here, once.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import fields

MODEL_TYPES = ("deepseek_v4", "deepseek_v41")

# Keys a real config.json carries that do not change the text model's math.
_IGNORED_KEYS = {
    "architectures", "transformers_version", "torch_dtype", "dtype", "initializer_range", "use_cache",
    "attention_dropout", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "auto_map",
    "vision_config", "image_token_id", "partial_rotary_factor", "num_key_value_heads", "hidden_act",
    "attention_bias", "mlp_bias", "tie_word_embeddings", "text_config", "quantization_config", "rope_scaling",
    "rope_parameters", "layer_types", "compress_rates", "mlp_layer_types", "compress_ratios", "model_type",
    "expert_dtype", "num_hash_layers", "qk_rope_head_dim", "bias_vl", "gate_temp", "engram_enabled",
    "engram_trainable", "is_encoder_decoder", "pretraining_tp", "name_or_path", "_name_or_path",
}
_LAYER_TYPE_RATIO = {"sliding_attention": 0}
_LAYER_TYPE_DEFAULT_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


class ConfigError(ValueError):
    """A config value is unknown, missing or inconsistent; the message names the field."""


@dataclass(slots=True)
class ModelConfig:
    """Text-model hyper-parameters of V4 / V4.1 (names follow the HF config keys)."""

    model_type: str = "deepseek_v41"
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    num_hash_layers: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    num_nextn_predict_layers: int = 3
    weight_block_size: tuple[int, int] = (32, 32)
    expert_dtype: str = "fp4"
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = 2
    # V4.1 only (empty / -1 for V4)
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_compressed_vocab_size: int = 99092
    engram_pad_token_id: int = 2
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3

    # ---- derived schedule -------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.model_type == "deepseek_v41"

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def ratio(self, layer: int) -> int:
        """Compression ratio of a layer (0 = window only)."""
        return self.compress_ratios[layer]

    def attention_kind(self, layer: int) -> str:
        """V4: 'swa' | 'csa' (ratio 4, overlapping + indexer) | 'hca'; V4.1: 'swa' | 'full' | 'reindex' | 'reuse'."""
        ratio = self.ratio(layer)
        if ratio == 0:
            return "swa"
        if not self.is_v41:
            return "csa" if ratio == 4 else "hca"
        if layer in self.kv_source_layer_ids:
            return "full"
        return "reindex" if layer in self.index_source_layer_ids else "reuse"

    def kv_source(self, layer: int) -> int:
        """V4.1: the KV-source layer whose compressed rows `layer` attends to."""
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def index_source(self, layer: int) -> int:
        """V4.1: the layer whose top-k selection `layer` uses (itself for Full / Reindex layers)."""
        return max(s for s in self.index_source_layer_ids if s <= layer)

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    # ---- (de)serialisation --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build and validate a config from a checkpoint's config.json content."""
        if not isinstance(raw, dict):
            raise ConfigError("config: expected a JSON object")
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type: unknown value {model_type!r}; expected one of {MODEL_TYPES}")
        text = dict(raw)
        if model_type == "deepseek_v41":
            if "text_config" not in raw:
                raise ConfigError("text_config: missing; a deepseek_v41 config.json nests the text model's "
                                  "fields under text_config")
            if not isinstance(raw["text_config"], dict):
                raise ConfigError(f"text_config: expected a JSON object, got {type(raw['text_config']).__name__}")
            text = {**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}
            text["model_type"] = model_type
        return _parse(text, model_type)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"config: cannot read {path}: {err}") from err
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        """The HF-style config.json content (V4 flat, V4.1 nested under `text_config`)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("rope_factor", "original_max_position_embeddings", "beta_fast",
                          "beta_slow", "weight_block_size", "expert_dtype"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["rope_scaling"] = {"type": "yarn", "factor": self.rope_factor, "beta_fast": self.beta_fast,
                               "beta_slow": self.beta_slow,
                               "original_max_position_embeddings": self.original_max_position_embeddings}
        quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                 "weight_block_size": list(self.weight_block_size), "expert_dtype": self.expert_dtype}
        if not self.is_v41:
            for key in [k for k in out if k.startswith(("engram_", "dspark_", "candidate_"))]:
                del out[key]
            for key in ("kv_source_layer_ids", "index_source_layer_ids"):
                del out[key]
            arch = "DeepseekV4ForCausalLM"
            return {"architectures": [arch], **out, "expert_dtype": self.expert_dtype,
                    "quantization_config": quant}
        del out["num_hash_layers"]
        top = {k: out.pop(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        out.pop("model_type")
        return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", **top,
                "text_config": out, "quantization_config": quant}

    def replace(self, **changes: Any) -> ModelConfig:
        """A validated copy with some fields changed."""
        return _validate(dataclasses.replace(self, **changes))


# ---- parsing helpers ----------------------------------------------------------------------------

def _field_names() -> set[str]:
    return {f.name for f in dataclasses.fields(ModelConfig)}


def _parse(text: dict[str, Any], model_type: str) -> ModelConfig:
    known = _field_names()
    unknown = sorted(k for k in text if k not in known and k not in _IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown config field (all unknown: {unknown})")
    defaults = _V4_DEFAULTS if model_type == "deepseek_v4" else {}
    kwargs: dict[str, Any] = {**defaults}
    for key in known & set(text):
        kwargs[key] = text[key]
    kwargs["model_type"] = model_type
    _check_types(kwargs)
    n_layers = kwargs.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    kwargs["compress_ratios"] = _compress_ratios(text, n_layers, kwargs.get("num_nextn_predict_layers", 0))
    kwargs.update(_rope_fields(text))
    kwargs.update(_quant_fields(text))
    if "qk_rope_head_dim" not in text and "partial_rotary_factor" in text:
        factor = text["partial_rotary_factor"]
        _require(fields.is_number(factor) and 0 < factor <= 1, "partial_rotary_factor",
                 f"expected a number in (0, 1], got {factor!r}")
        kwargs["qk_rope_head_dim"] = round(factor * kwargs.get("head_dim", 512))
    if model_type == "deepseek_v4" and "num_hash_layers" not in text and "mlp_layer_types" in text:
        _require(isinstance(text["mlp_layer_types"], list), "mlp_layer_types", "expected a list")
        kwargs["num_hash_layers"] = sum(1 for t in text["mlp_layer_types"] if t == "hash_moe")
    _check_types(kwargs)
    _check_fixed_values(text)
    for key, value in list(kwargs.items()):
        if isinstance(value, list):
            kwargs[key] = tuple(value)
    try:
        cfg = ModelConfig(**kwargs)
    except TypeError as err:
        raise ConfigError(f"config: {err}") from err
    return _validate(cfg)


def _compress_ratios(text: dict[str, Any], n_layers: int, n_extra: int) -> tuple[int, ...]:
    if "compress_ratios" in text:
        ratios = text["compress_ratios"]
        if not isinstance(ratios, list) or not all(isinstance(r, int) and r >= 0 for r in ratios):
            raise ConfigError("compress_ratios: expected a list of non-negative integers")
        return tuple(ratios)
    if "layer_types" in text:
        _require(isinstance(text["layer_types"], list), "layer_types", "expected a list of layer type names")
        given = text.get("compress_rates") or {}
        _require(isinstance(given, dict) and all(fields.is_int(r) and r > 0 for r in given.values()),
                 "compress_rates", f"expected an object of positive integers, got {given!r}")
        rates = {**_LAYER_TYPE_DEFAULT_RATES, **given, **_LAYER_TYPE_RATIO}
        bad = [t for t in text["layer_types"] if not isinstance(t, str) or t not in rates]
        if bad:
            raise ConfigError(f"layer_types: unknown layer type {bad[0]!r}")
        return tuple(rates[t] for t in text["layer_types"]) + (0,) * n_extra
    raise ConfigError("compress_ratios: missing (neither compress_ratios nor layer_types is given)")


def _rope_fields(text: dict[str, Any]) -> dict[str, Any]:
    key = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    rope = text.get(key) or {}
    _require(isinstance(rope, dict), key, f"expected a JSON object, got {rope!r}")
    if isinstance(rope.get("compress"), dict):
        rope, key = rope["compress"], key + ".compress"
    if not rope:
        return {}
    kind = rope.get("type", rope.get("rope_type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.type: unsupported value {kind!r}; expected 'yarn'")
    names = {"factor": ("rope_factor", 16.0), "original_max_position_embeddings":
             ("original_max_position_embeddings", 65536), "beta_fast": ("beta_fast", 32.0),
             "beta_slow": ("beta_slow", 1.0)}
    out = {}
    for src, (dst, default) in names.items():
        value = rope.get(src, default)
        problem = fields.check_field(dst, value)
        _require(problem is None, f"{key}.{src}", problem or "")
        out[dst] = value if fields.is_int(default) else float(value)
    if "rope_theta" in rope and "compress_rope_theta" not in text:
        problem = fields.check_field("compress_rope_theta", rope["rope_theta"])
        _require(problem is None, f"{key}.rope_theta", problem or "")
        out["compress_rope_theta"] = float(rope["rope_theta"])
    return out


def _quant_fields(text: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    quant = text.get("quantization_config") or {}
    _require(isinstance(quant, dict), "quantization_config", f"expected a JSON object, got {quant!r}")
    if quant:
        if quant.get("quant_method", "fp8") != "fp8":
            raise ConfigError(f"quantization_config.quant_method: unsupported value {quant['quant_method']!r}")
        if quant.get("scale_fmt", "ue8m0") != "ue8m0":
            raise ConfigError(f"quantization_config.scale_fmt: unsupported value {quant['scale_fmt']!r}")
        if "weight_block_size" in quant:
            block = quant["weight_block_size"]
            if not (isinstance(block, list) and len(block) == 2 and fields.is_int(block[0]) and block[0] == block[1]
                    and block[0] > 0):
                raise ConfigError(f"quantization_config.weight_block_size: expected [b, b], got {block!r}")
            out["weight_block_size"] = tuple(block)
    expert = quant.get("expert_dtype", text.get("expert_dtype"))
    if expert is not None:
        out["expert_dtype"] = expert
    return out


def _check_fixed_values(text: dict[str, Any]) -> None:
    fixed = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
             "num_key_value_heads": 1}
    for key, want in fixed.items():
        if key in text and text[key] != want:
            raise ConfigError(f"{key}: unsupported value {text[key]!r}; this model needs {want!r}")


def _require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


def _check_types(values: dict[str, Any]) -> None:
    """Every known field's type and range (fields.py); the first bad one raises, named."""
    for name in [f.name for f in dataclasses.fields(ModelConfig) if f.name in values]:
        problem = fields.check_field(name, values[name])
        _require(problem is None, name, problem or "")


def _validate(c: ModelConfig) -> ModelConfig:
    """Check types, ranges and consistency; every failure names the offending field."""
    _check_types({f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
    for name in fields.float_fields():  # JSON integers (rope_theta: 10000) are stored as floats
        object.__setattr__(c, name, float(getattr(c, name)))
    for name in ("index_topk", "sliding_window"):
        _require(getattr(c, name) <= c.max_position_embeddings, name,
                 f"{getattr(c, name)} exceeds max_position_embeddings ({c.max_position_embeddings})")
    if c.is_v41:
        pool = c.candidate_topk_blocks * c.candidate_block_size
        _require(pool <= c.max_position_embeddings, "candidate_topk_blocks",
                 f"a pool of {c.candidate_topk_blocks} x candidate_block_size {c.candidate_block_size} = {pool} "
                 f"positions exceeds max_position_embeddings ({c.max_position_embeddings})")
    _require(c.scoring_func == "sqrtsoftplus", "scoring_func", f"unsupported value {c.scoring_func!r}")
    _require(c.topk_method == "noaux_tc", "topk_method", f"unsupported value {c.topk_method!r}")
    _require(c.expert_dtype in ("fp4", "fp8"), "expert_dtype", f"unsupported value {c.expert_dtype!r}")
    _require(c.norm_topk_prob is True, "norm_topk_prob", "only true is supported")
    _require(0 < c.qk_rope_head_dim <= c.head_dim and c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             f"must be even and within head_dim ({c.head_dim}), got {c.qk_rope_head_dim}")
    _require(c.qk_rope_head_dim <= c.index_head_dim, "index_head_dim",
             f"must hold the {c.qk_rope_head_dim} rope channels")
    _require((c.num_attention_heads * c.head_dim) % c.o_groups == 0, "o_groups",
             "must divide num_attention_heads * head_dim")
    _require(c.num_experts_per_tok <= c.n_routed_experts, "num_experts_per_tok", "exceeds n_routed_experts")
    _require(c.n_shared_experts in (0, 1), "n_shared_experts", "only 0 or 1 shared expert is supported")
    n_total = c.num_hidden_layers + c.num_nextn_predict_layers
    _require(len(c.compress_ratios) == n_total, "compress_ratios",
             f"has {len(c.compress_ratios)} entries; expected num_hidden_layers + num_nextn_predict_layers "
             f"= {n_total}")
    _require(all(r == 0 for r in c.compress_ratios[c.num_hidden_layers:]), "compress_ratios",
             "MTP / DSpark entries must be 0")
    _require(c.weight_block_size[0] in (32, 64, 128), "weight_block_size", f"unsupported {c.weight_block_size}")
    return _validate_v41(c) if c.is_v41 else _validate_v4(c)


def _validate_v4(c: ModelConfig) -> ModelConfig:
    _require(c.num_hash_layers <= c.num_hidden_layers, "num_hash_layers", "exceeds num_hidden_layers")
    for layer, ratio in enumerate(c.compress_ratios[: c.num_hidden_layers]):
        _require(ratio in (0, 4) or ratio > 4, "compress_ratios",
                 f"layer {layer} has ratio {ratio}; V4 supports 0, 4 (CSA) or > 4 (HCA)")
    _require(c.index_head_dim % 32 == 0, "index_head_dim", "must be a multiple of 32 (FP4 blocks)")
    _require(c.index_head_dim & (c.index_head_dim - 1) == 0, "index_head_dim",
             "must be a power of two (Walsh-Hadamard transform)")
    _require(c.nope_head_dim % 64 == 0, "head_dim", "the nope part must be a multiple of 64 (KV FP8 blocks)")
    _require(not c.kv_source_layer_ids and not c.engram_layer_ids, "kv_source_layer_ids",
             "V4.1 fields given for a deepseek_v4 model")
    return c


def _validate_v41(c: ModelConfig) -> ModelConfig:
    n = c.num_hidden_layers
    _require(c.num_hash_layers == 0, "num_hash_layers", "V4.1 has no hash-routed layers")
    _require(c.head_dim % 32 == 0 and c.index_head_dim % 32 == 0, "head_dim", "must be a multiple of 32")
    srcs = c.kv_source_layer_ids
    _require(list(srcs) == sorted(set(srcs)) and all(0 <= s < n for s in srcs), "kv_source_layer_ids",
             f"must be sorted distinct layer ids below {n}")
    idx = c.index_source_layer_ids
    _require(list(idx) == sorted(set(idx)) and set(srcs) <= set(idx), "index_source_layer_ids",
             "must be sorted and contain every kv source layer")
    for layer in range(n):
        ratio = c.ratio(layer)
        _require(ratio in (0, 1, 2), "compress_ratios", f"layer {layer} has ratio {ratio}; V4.1 supports 0, 1, 2")
        if ratio == 0:
            _require(layer not in idx, "index_source_layer_ids", f"layer {layer} has ratio 0")
            continue
        earlier = [s for s in srcs if s <= layer]
        _require(bool(earlier), "kv_source_layer_ids", f"compressed layer {layer} has no KV source at or before it")
        _require(c.ratio(earlier[-1]) == ratio, "compress_ratios",
                 f"layer {layer} (ratio {ratio}) differs from its KV source {earlier[-1]}")
        if layer in idx and layer not in srcs:
            _require(0 <= c.candidate_source_layer_id < layer, "candidate_source_layer_id",
                     f"Reindex layer {layer} needs an earlier candidate source")
    if c.candidate_source_layer_id >= 0:
        _require(c.candidate_source_layer_id in srcs, "candidate_source_layer_id", "must be a kv source layer")
    _require(len(c.engram_num_embeddings) == len(c.engram_layer_ids), "engram_num_embeddings",
             "needs one entry per engram layer")
    _require(all(0 <= e < n for e in c.engram_layer_ids), "engram_layer_ids", f"must be below {n}")
    _require(c.engram_max_ngram_size >= 2, "engram_max_ngram_size", "must be at least 2")
    return c


_V4_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096, "num_hidden_layers": 43, "q_lora_rank": 1024, "index_n_heads": 64,
    "n_routed_experts": 256, "moe_intermediate_size": 2048, "num_hash_layers": 3, "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1, "weight_block_size": (128, 128), "pad_token_id": None,
}
