"""What a config costs before anything is allocated: tensor count, weight bytes, a step's working set.

Every size here is computed from the config alone (no tensor is built), so a config.json with an
absurd value - `index_topk = 10**6`, a million experts - is refused with a `ConfigError` naming the
field whose bytes dominate, instead of growing the process until the machine kills it.

The estimates are deliberately simple upper bounds of the reference's own behaviour: it keeps every
weight dequantised in FP32 (4 bytes per value), gives every query of a step a key set of
`sliding_window + index_topk (+ the V4.1 candidate pool)` rows of `head_dim` FP32 values, and holds
one BF16/FP32 window ring per layer and sequence.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import ConfigError, ModelConfig
from .inventory import _block, _hc_head

MAX_TENSORS = 1_000_000  # the released V4.1 inventory has about 50 000 logical tensors
HEADROOM = 0.9  # refuse when an estimate exceeds this share of the available memory


def _numel(specs) -> int:
    total = 0
    for spec in specs:
        n = 1
        for dim in spec.shape:
            n *= dim
        total += n
    return total


def _layers(cfg: ModelConfig):
    """(prefix, layer index, routed experts) of every block, decoder layers then MTP / DSpark."""
    for layer in range(cfg.num_hidden_layers):
        yield f"layers.{layer}.", layer, cfg.n_routed_experts
    for j in range(cfg.num_nextn_predict_layers):
        n_exp = cfg.dspark_n_routed_experts if cfg.is_v41 else cfg.n_routed_experts
        yield f"mtp.{j}.", cfg.num_hidden_layers + j, n_exp


def _expert_field(cfg: ModelConfig, layer: int) -> str:
    return "dspark_n_routed_experts" if cfg.is_v41 and layer >= cfg.num_hidden_layers else "n_routed_experts"


def tensor_count(cfg: ModelConfig) -> tuple[int, str]:
    """Logical tensors of the inventory, and the field that multiplies most of them."""
    count, by_experts = 2 + 1 + 3 * (not cfg.is_v41), 0
    for p, layer, n_exp in _layers(cfg):
        count += len(_block(cfg, p, layer, experts=1)) + 8
        by_experts += 3 * (n_exp - 1)
    return count + by_experts, "n_routed_experts" if by_experts > count else "num_hidden_layers"


def check_tensor_count(cfg: ModelConfig) -> None:
    """Refuse a config whose inventory alone would be millions of tensors (before listing them)."""
    count, field = tensor_count(cfg)
    if count > MAX_TENSORS:
        raise ConfigError(f"{field}: the config implies {count} checkpoint tensors (more than {MAX_TENSORS}); "
                          f"{field} = {getattr(cfg, field)} is not a real model")


def weight_bytes(cfg: ModelConfig) -> dict[str, int]:
    """FP32 bytes of the dequantised weights the reference holds, by the field that drives each group."""
    d = cfg.hidden_size
    per_expert = 3 * cfg.moe_intermediate_size * d + d + 2  # w1, w3, w2, its router row and biases
    groups = {"vocab_size": 2 * cfg.vocab_size * d, "n_routed_experts": 0, "dspark_n_routed_experts": 0,
              "engram_num_embeddings": 0, "num_hidden_layers": d + 2 * d * d}  # final norm; MTP projections
    for p, layer, n_exp in _layers(cfg):
        one = _block(cfg, p, layer, experts=1)
        engram = _numel(s for s in one if s.name.endswith("engram.embed"))
        groups["engram_num_embeddings"] += engram
        groups[_expert_field(cfg, layer)] += n_exp * per_expert
        groups["num_hidden_layers"] += _numel(one) - engram - per_expert
    if not cfg.is_v41:
        groups["num_hidden_layers"] += 2 * _numel(_hc_head(cfg, ""))
    return {k: 4 * v for k, v in groups.items() if v}


def key_slots(cfg: ModelConfig) -> dict[str, int]:
    """Rows in one query's attention key set, by field."""
    slots = {"sliding_window": cfg.sliding_window, "index_topk": cfg.index_topk}
    if cfg.is_v41:
        slots["candidate_topk_blocks"] = cfg.candidate_topk_blocks * cfg.candidate_block_size
    return slots


def step_bytes(cfg: ModelConfig, tokens: int, batch_invariant: bool = False) -> int:
    """Working set of one step of `tokens` queries: key sets, their products and attention weights."""
    heads, dim = cfg.num_attention_heads, cfg.head_dim
    per_slot = 4 * (2 * dim + 4 * heads + 2) + (4 * heads * dim if batch_invariant else 0)
    return tokens * sum(key_slots(cfg).values()) * per_slot


def ring_bytes(cfg: ModelConfig, seqs: int, dtype: torch.dtype) -> int:
    """The window rings every admitted sequence allocates at once."""
    return seqs * cfg.num_hidden_layers * cfg.sliding_window * cfg.head_dim * dtype.itemsize


def available_bytes(device: torch.device) -> int:
    """Memory a new allocation can use: free device memory on CUDA, else MemAvailable within the cgroup."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return 1 << 62  # unknown: do not refuse
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**40 else f"{n / 2**40:.1f} TiB"


def check_fits(cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype, max_num_seqs: int,
               max_num_batched_tokens: int, batch_invariant: bool = False) -> None:
    """Refuse, naming the dominant field, a config whose weights + one full step cannot fit."""
    avail = available_bytes(device)
    weights = weight_bytes(cfg)
    step = step_bytes(cfg, max_num_batched_tokens, batch_invariant)
    rings = ring_bytes(cfg, max_num_seqs, dtype)
    total = sum(weights.values()) + step + rings
    if total <= HEADROOM * avail:
        return
    parts = {**weights, "sliding_window": rings}
    slots = key_slots(cfg)
    top_slot = max(slots, key=slots.get)
    parts[top_slot] = parts.get(top_slot, 0) + step
    field = max(parts, key=parts.get)
    value = getattr(cfg, field)
    shown = f"{field} = {value if not isinstance(value, tuple) else list(value)}"
    keys = " + ".join(f"{k} {v}" for k, v in slots.items())
    what = {"sliding_window": "window rings and key sets",
            top_slot: f"a step of {max_num_batched_tokens} tokens (key sets of {keys} rows)"}
    what = what.get(field, "dequantised FP32 weights")
    raise ConfigError(f"{field}: this model would need about {gib(total)} on {device} ({gib(parts[field])} from "
                      f"{what}, {shown}); only {gib(avail)} is available")
