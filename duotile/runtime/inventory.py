"""The tensor inventory of a checkpoint: official names, logical shapes and storage formats.

V4 follows model.md 1.4 exactly. V4.1 keeps the V4 names and adds the CSA2 compressor / index-key
projections on KV-source layers (`attn.compressor.{wkv,wgate,norm}`, `attn.indexer.{wk,k_norm}`), the
index-query projections on index-source layers (`attn.indexer.{wq_b,weights_proj}`), the visual router
bias `ffn.gate.bias_vl`, and Engram (`engram.embed` FP8 rows with UE8M0 per 32, `engram.wkv`,
`engram.q_weight`, `engram.k_weight`). The MTP layer (V4) and the DSpark blocks (V4.1, `mtp.{j}`) are
listed so that a checkpoint is complete; the runtime loads them but does not run them.

Storage kinds: `fp8` = e4m3 `.weight` + UE8M0 `.scale` per weight_block_size tile; `fp4` = packed e2m1
`.weight` (int8, two per byte) + UE8M0 `.scale` per 32 inputs; `fp8row` = e4m3 rows + UE8M0 per 32;
`bf16`, `fp32`, `int32` = plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One logical tensor: `name` without the `.weight` / `.scale` suffix for quantised kinds."""

    name: str
    shape: tuple[int, ...]
    kind: str  # fp8 | fp4 | fp8row | bf16 | fp32 | int32

    def stored(self, block: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The safetensors entries (name -> (shape, dtype)) this logical tensor occupies."""
        if self.kind == "fp8":
            out_dim, in_dim = self.shape
            return {f"{self.name}.weight": (self.shape, torch.float8_e4m3fn),
                    f"{self.name}.scale": ((-(-out_dim // block), -(-in_dim // block)), torch.float8_e8m0fnu)}
        if self.kind == "fp4":
            out_dim, in_dim = self.shape
            return {f"{self.name}.weight": ((out_dim, in_dim // 2), torch.int8),
                    f"{self.name}.scale": ((out_dim, in_dim // 32), torch.float8_e8m0fnu)}
        if self.kind == "fp8row":
            rows, dim = self.shape
            return {f"{self.name}.weight": (self.shape, torch.float8_e4m3fn),
                    f"{self.name}.scale": ((rows, dim // 32), torch.float8_e8m0fnu)}
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32}[self.kind]
        return {self.name: (self.shape, dtype)}


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every logical tensor of a checkpoint for `cfg`, in a stable order."""
    d_model = cfg.hidden_size
    specs = [TensorSpec("embed.weight", (cfg.vocab_size, d_model), "bf16")]
    for layer in range(cfg.num_hidden_layers):
        specs += _block(cfg, f"layers.{layer}.", layer)
    specs += [TensorSpec("norm.weight", (d_model,), "bf16"),
              TensorSpec("head.weight", (cfg.vocab_size, d_model), "bf16")]
    if not cfg.is_v41:
        specs += _hc_head(cfg, "")
    for j in range(cfg.num_nextn_predict_layers):
        specs += _nextn(cfg, j)
    return specs


def _block(cfg: ModelConfig, p: str, layer: int, *, experts: int | None = None) -> list[TensorSpec]:
    d_model, n = cfg.hidden_size, cfg.hc_mult
    mix = (2 + n) * n
    specs = [TensorSpec(f"{p}attn_norm.weight", (d_model,), "bf16"),
             TensorSpec(f"{p}ffn_norm.weight", (d_model,), "bf16")]
    for site in ("attn", "ffn"):
        specs += [TensorSpec(f"{p}hc_{site}_fn", (mix, n * d_model), "fp32"),
                  TensorSpec(f"{p}hc_{site}_base", (mix,), "fp32"), TensorSpec(f"{p}hc_{site}_scale", (3,), "fp32")]
    specs += _attention(cfg, p + "attn.", layer)
    specs += _moe(cfg, p + "ffn.", layer, experts)
    if layer in cfg.engram_layer_ids:
        specs += _engram(cfg, p + "engram.", layer)
    return specs


def _attention(cfg: ModelConfig, p: str, layer: int) -> list[TensorSpec]:
    d_model, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    specs = [TensorSpec(f"{p}wq_a", (cfg.q_lora_rank, d_model), "fp8"),
             TensorSpec(f"{p}q_norm.weight", (cfg.q_lora_rank,), "bf16"),
             TensorSpec(f"{p}wq_b", (heads * hd, cfg.q_lora_rank), "fp8"),
             TensorSpec(f"{p}wkv", (hd, d_model), "fp8"),
             TensorSpec(f"{p}kv_norm.weight", (hd,), "bf16"),
             TensorSpec(f"{p}wo_a", (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups), "fp8"),
             TensorSpec(f"{p}wo_b", (d_model, cfg.o_groups * cfg.o_lora_rank), "fp8"),
             TensorSpec(f"{p}attn_sink", (heads,), "fp32")]
    ratio = cfg.ratio(layer) if layer < cfg.num_hidden_layers else 0
    if ratio == 0:
        return specs
    if cfg.is_v41:
        return specs + _csa2(cfg, p, layer)
    width = 2 * hd if ratio == 4 else hd
    specs += _compressor(f"{p}compressor.", width, ratio, hd, d_model)
    if ratio == 4:
        di = cfg.index_head_dim
        specs += [TensorSpec(f"{p}indexer.wq_b", (cfg.index_n_heads * di, cfg.q_lora_rank), "fp8"),
                  TensorSpec(f"{p}indexer.weights_proj.weight", (cfg.index_n_heads, d_model), "bf16")]
        specs += _compressor(f"{p}indexer.compressor.", 2 * di, 4, di, d_model)
    return specs


def _compressor(p: str, width: int, ratio: int, norm_dim: int, d_model: int) -> list[TensorSpec]:
    return [TensorSpec(f"{p}wkv.weight", (width, d_model), "bf16"),
            TensorSpec(f"{p}wgate.weight", (width, d_model), "bf16"),
            TensorSpec(f"{p}ape", (ratio, width), "fp32"), TensorSpec(f"{p}norm.weight", (norm_dim,), "bf16")]


def _csa2(cfg: ModelConfig, p: str, layer: int) -> list[TensorSpec]:
    d_model, hd, di = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    specs: list[TensorSpec] = []
    if layer in cfg.kv_source_layer_ids:
        specs.append(TensorSpec(f"{p}compressor.wkv.weight", (hd, d_model), "fp32"))
        if cfg.ratio(layer) > 1:
            specs.append(TensorSpec(f"{p}compressor.wgate.weight", (hd, d_model), "fp32"))
        specs += [TensorSpec(f"{p}compressor.norm.weight", (hd,), "bf16"),
                  TensorSpec(f"{p}indexer.wk.weight", (di, hd), "bf16"),
                  TensorSpec(f"{p}indexer.k_norm.weight", (di,), "bf16")]
    if layer in cfg.index_source_layer_ids:
        specs += [TensorSpec(f"{p}indexer.wq_b", (cfg.index_n_heads * di, cfg.q_lora_rank), "fp8"),
                  TensorSpec(f"{p}indexer.weights_proj.weight", (cfg.index_n_heads, d_model), "bf16")]
    return specs


def _moe(cfg: ModelConfig, p: str, layer: int, experts: int | None) -> list[TensorSpec]:
    d_model, inter = cfg.hidden_size, cfg.moe_intermediate_size
    n_exp = experts or cfg.n_routed_experts
    specs = [TensorSpec(f"{p}gate.weight", (n_exp, d_model), "bf16")]
    if cfg.is_hash_layer(layer) and layer < cfg.num_hidden_layers:
        specs.append(TensorSpec(f"{p}gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "int32"))
    else:
        specs.append(TensorSpec(f"{p}gate.bias", (n_exp,), "fp32"))
        if cfg.is_v41:
            specs.append(TensorSpec(f"{p}gate.bias_vl", (n_exp,), "fp32"))
    kind = cfg.expert_dtype
    for e in range(n_exp):
        specs += [TensorSpec(f"{p}experts.{e}.w1", (inter, d_model), kind),
                  TensorSpec(f"{p}experts.{e}.w3", (inter, d_model), kind),
                  TensorSpec(f"{p}experts.{e}.w2", (d_model, inter), kind)]
    for _ in range(cfg.n_shared_experts):
        specs += [TensorSpec(f"{p}shared_experts.w1", (inter, d_model), "fp8"),
                  TensorSpec(f"{p}shared_experts.w3", (inter, d_model), "fp8"),
                  TensorSpec(f"{p}shared_experts.w2", (d_model, inter), "fp8")]
    return specs


def _engram(cfg: ModelConfig, p: str, layer: int) -> list[TensorSpec]:
    rows = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    d_model, n = cfg.hidden_size, cfg.hc_mult
    return [TensorSpec(f"{p}embed", (rows, cfg.engram_head_dim), "fp8row"),
            TensorSpec(f"{p}wkv", ((n + 1) * d_model, cols * cfg.engram_head_dim), "fp8"),
            TensorSpec(f"{p}q_weight", (n, d_model), "bf16"), TensorSpec(f"{p}k_weight", (n, d_model), "bf16")]


def _hc_head(cfg: ModelConfig, p: str) -> list[TensorSpec]:
    n, d_model = cfg.hc_mult, cfg.hidden_size
    return [TensorSpec(f"{p}hc_head_fn", (n, n * d_model), "fp32"), TensorSpec(f"{p}hc_head_base", (n,), "fp32"),
            TensorSpec(f"{p}hc_head_scale", (1,), "fp32")]


def _nextn(cfg: ModelConfig, j: int) -> list[TensorSpec]:
    """V4: the MTP layer (model.md 2.9). V4.1: a DSpark block (internals beyond the block are [U])."""
    p, layer, d_model = f"mtp.{j}.", cfg.num_hidden_layers + j, cfg.hidden_size
    if cfg.is_v41:
        return _block(cfg, p, layer, experts=cfg.dspark_n_routed_experts) + [
            TensorSpec(f"{p}norm.weight", (d_model,), "bf16")]
    return _block(cfg, p, layer) + [
        TensorSpec(f"{p}e_proj", (d_model, d_model), "fp8"), TensorSpec(f"{p}h_proj", (d_model, d_model), "fp8"),
        TensorSpec(f"{p}enorm.weight", (d_model,), "bf16"), TensorSpec(f"{p}hnorm.weight", (d_model,), "bf16"),
        TensorSpec(f"{p}norm.weight", (d_model,), "bf16")] + _hc_head(cfg, p)
