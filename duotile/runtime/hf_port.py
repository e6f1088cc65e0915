"""Our V4 checkpoints in Hugging Face transformers' ``DeepseekV4ForCausalLM``: its config and its
weights, named as its module tree holds them (for the conformance test and the model benchmark).

transformers is a float transcription of the released model: it leaves out the quantisation round
trips (model.md 1.6), so a weight reaches it dequantised (exact in BF16 and FP32). It is imported
only when a config is made; the runtime never needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .config import ConfigError, ModelConfig

_KIND = {0: "sliding_attention", 4: "compressed_sparse_attention"}


def hf_config(cfg: ModelConfig, dtype: str = "float32"):
    """transformers' ``DeepseekV4Config`` for a V4 ``cfg`` (its MTP layers left out)."""
    if cfg.is_v41:
        raise ConfigError("hf_config: transformers has no V4.1 model; only a deepseek_v4 config ports")
    import transformers

    return transformers.DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1, head_dim=cfg.head_dim,
        partial_rotary_factor=cfg.qk_rope_head_dim / cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.sliding_window,
        layer_types=[_KIND.get(cfg.ratio(i), "heavily_compressed_attention") for i in range(cfg.num_hidden_layers)],
        compress_rates={"compressed_sparse_attention": 4,
                        "heavily_compressed_attention": max(cfg.compress_ratios)},
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.num_hidden_layers)],
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk,
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.n_shared_experts, moe_intermediate_size=cfg.moe_intermediate_size,
        routed_scaling_factor=cfg.routed_scaling_factor, swiglu_limit=cfg.swiglu_limit,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        rope_parameters={"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast,
                         "beta_slow": cfg.beta_slow,
                         "original_max_position_embeddings": cfg.original_max_position_embeddings},
        max_position_embeddings=cfg.max_position_embeddings, num_nextn_predict_layers=0, dtype=dtype,
    )


def hf_tensors(cfg: ModelConfig, get: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers' name, value) for every weight of its module tree, from ``get`` (our official
    tensor name -> dequantised value), one layer at a time: the inverse of transformers' conversion
    mapping. A layer's routed experts come stacked, as transformers keeps them."""
    for i in range(-1, cfg.num_hidden_layers):
        out: dict[str, torch.Tensor] = {}
        if i < 0:
            _model_tensors(cfg, get, out)
        else:
            _layer_tensors(cfg, get, i, out)
        yield from out.items()


def _model_tensors(cfg: ModelConfig, g, out: dict) -> None:
    out["model.embed_tokens.weight"], out["lm_head.weight"] = g("embed.weight"), g("head.weight")
    out["model.norm.weight"] = g("norm.weight")
    for ours, theirs in (("fn", "hc_fn"), ("base", "hc_base"), ("scale", "hc_scale")):
        out[f"model.hc_head.{theirs}"] = g(f"hc_head_{ours}")


def _layer_tensors(cfg: ModelConfig, g, i: int, out: dict) -> None:
    p, q = f"layers.{i}.", f"model.layers.{i}."
    out[q + "input_layernorm.weight"], out[q + "post_attention_layernorm.weight"] = (
        g(p + "attn_norm.weight"), g(p + "ffn_norm.weight"))
    for site in ("attn", "ffn"):
        for part in ("fn", "base", "scale"):
            out[f"{q}{site}_hc.{part}"] = g(f"{p}hc_{site}_{part}")
    a, b = p + "attn.", q + "self_attn."
    for ours, theirs in (("wq_a", "q_a_proj"), ("wq_b", "q_b_proj"), ("wkv", "kv_proj"), ("wo_a", "o_a_proj"),
                         ("wo_b", "o_b_proj")):
        out[f"{b}{theirs}.weight"] = g(a + ours)
    out[b + "q_a_norm.weight"], out[b + "kv_norm.weight"] = g(a + "q_norm.weight"), g(a + "kv_norm.weight")
    out[b + "sinks"] = g(a + "attn_sink")
    if cfg.ratio(i):
        _compressor(out, g, a + "compressor.", b + "compressor.")
    if cfg.ratio(i) == 4:
        _compressor(out, g, a + "indexer.compressor.", b + "compressor.indexer.")
        out[b + "compressor.indexer.q_b_proj.weight"] = g(a + "indexer.wq_b")
        out[b + "compressor.indexer.scorer.weights_proj.weight"] = g(a + "indexer.weights_proj.weight")
    _ffn_tensors(cfg, g, i, p + "ffn.", q + "mlp.", out)


def _ffn_tensors(cfg: ModelConfig, g, i: int, f: str, m: str, out: dict) -> None:
    out[m + "gate.weight"] = g(f + "gate.weight")
    if cfg.is_hash_layer(i):
        out[m + "gate.tid2eid"] = g(f + "gate.tid2eid")
    else:
        out[m + "gate.e_score_correction_bias"] = g(f + "gate.bias")
    experts = range(cfg.n_routed_experts)
    out[m + "experts.gate_up_proj"] = torch.stack(
        [torch.cat([g(f"{f}experts.{e}.w1"), g(f"{f}experts.{e}.w3")]) for e in experts])
    out[m + "experts.down_proj"] = torch.stack([g(f"{f}experts.{e}.w2") for e in experts])
    for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        out[f"{m}shared_experts.{theirs}.weight"] = g(f"{f}shared_experts.{ours}")


def _compressor(out, g, ours: str, theirs: str) -> None:
    out[theirs + "kv_proj.weight"], out[theirs + "gate_proj.weight"] = g(ours + "wkv.weight"), g(ours + "wgate.weight")
    out[theirs + "position_bias"], out[theirs + "kv_norm.weight"] = g(ours + "ape"), g(ours + "norm.weight")
