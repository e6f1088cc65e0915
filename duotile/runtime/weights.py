"""Sharded safetensors checkpoints: a validating lazy reader and a random-checkpoint writer.

`Checkpoint.open(path)` reads `config.json`, the index (`model.safetensors.index.json`, or a single
`model.safetensors`) and every shard's header - not the data. It checks, before anything is used, that
the headers and the index are well formed (headers.py: offsets, overlaps, coverage, one shard per
tensor), and that each tensor of the inventory (inventory.py) is present with the right dtype and shape;
any problem raises `CheckpointError` naming the tensor and the file. Tensor data is read lazily through
safetensors' memory map, and `Checkpoint.get(name)` checks the stored codes (scan.py: NaN e4m3 / UE8M0
codes, non-finite floats, bad expert ids) and returns the dequantised FP32 value (FP8 x UE8M0 block
scale, packed FP4 x UE8M0 per 32). Every such product is exact in FP32 and in BF16, so dequantising
loses nothing. `Checkpoint.findings()` runs the same checks over every tensor (`duotile check-model`).

`write_random_checkpoint(cfg, path)` produces a valid checkpoint for any config: random weights scaled
so activations stay O(1), quantised to the released storage formats, split into shards with an index.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import quant
from .config import ModelConfig
from .footprint import check_tensor_count
from .headers import INDEX_NAME, SINGLE_NAME, CheckpointError, Entry, read_all_headers, read_header
from .inventory import TensorSpec, tensor_specs
from .scan import Finding, scan

__all__ = ["INDEX_NAME", "SINGLE_NAME", "Checkpoint", "CheckpointError", "read_header",
           "write_random_checkpoint"]


class Checkpoint:
    """A validated, lazily read checkpoint directory."""

    def __init__(self, path: Path, config: ModelConfig, entries: dict[str, Entry]):
        self.path, self.config, self.entries = path, config, entries
        self.specs = {s.name: s for s in tensor_specs(config)}
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json (not a checkpoint directory)")
        config = ModelConfig.from_file(path / "config.json")
        check_tensor_count(config)  # before the inventory is listed
        entries = read_all_headers(path)
        ckpt = cls(path, config, entries)
        ckpt.validate()
        return ckpt

    def validate(self) -> None:
        """Every inventory tensor present with its dtype and shape; nothing unexpected."""
        block = self.config.weight_block_size[0]
        expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for spec in self.specs.values():
            expected.update(spec.stored(block))
        for name, (shape, dtype) in expected.items():
            entry = self.entries.get(name)
            if entry is None:
                raise CheckpointError(f"tensor {name}: missing from checkpoint {self.path}")
            ok_dtype = entry.dtype == dtype or (dtype == torch.int32 and entry.dtype == torch.int64)
            if not ok_dtype:
                raise CheckpointError(f"tensor {name} in {entry.file}: dtype {entry.dtype}, expected {dtype}")
            if entry.shape != shape:
                raise CheckpointError(f"tensor {name} in {entry.file}: shape {list(entry.shape)}, "
                                      f"expected {list(shape)}")
        extra = sorted(set(self.entries) - set(expected))
        if extra:
            raise CheckpointError(f"tensor {extra[0]} in {self.entries[extra[0]].file}: not part of a "
                                  f"{self.config.model_type} checkpoint ({len(extra)} unexpected tensors)")

    def raw(self, name: str) -> torch.Tensor:
        """One stored tensor, read through the shard's memory map."""
        entry = self.entries[name]
        handle = self._handles.get(entry.file)
        if handle is None:
            handle = self._handles[entry.file] = safe_open(str(entry.file), framework="pt")
        return handle.get_tensor(name)

    def get(self, name: str) -> torch.Tensor:
        """The dequantised value of a logical tensor (FP32; integer tables stay integer).

        The stored codes are checked first (scan.py): a NaN / Inf code, an out-of-range expert id or an
        all-zero embedding / final norm / head raises CheckpointError naming the tensor and the file."""
        spec, parts = self._checked(name)
        if spec.kind == "fp8":
            return quant.dequantize_fp8_blocks(parts[f"{name}.weight"], parts[f"{name}.scale"],
                                               self.config.weight_block_size[0])
        if spec.kind == "fp4":
            return quant.dequantize_fp4_rows(parts[f"{name}.weight"], parts[f"{name}.scale"])
        if spec.kind == "fp8row":
            return quant.dequantize_fp8_rows(parts[f"{name}.weight"], parts[f"{name}.scale"])
        value = parts[name]
        return value.long() if spec.kind == "int32" else value.float()

    def packed(self, name: str) -> tuple[str, torch.Tensor, torch.Tensor]:
        """A quantised weight as stored, checked as ``get`` checks it but not dequantised: ``(kind,
        codes, scales)``, ``("fp8", e4m3 [N, K], UE8M0 codes [N / b, K / b] as uint8)`` for FP8
        blocks of b x b, ``("fp4", e2m1 pairs [N, K / 2] as uint8, UE8M0 codes [N, K / 32] as
        uint8)`` for MXFP4 rows: what the block-scaled kernels read, half a byte or a byte a weight
        where the dequantised value takes four."""
        spec, parts = self._checked(name)
        if spec.kind not in ("fp8", "fp4"):
            raise KeyError(f"{name}: a {spec.kind} tensor, not a packed weight")
        codes, scales = parts[f"{name}.weight"], parts[f"{name}.scale"]
        return spec.kind, codes if spec.kind == "fp8" else codes.view(torch.uint8), scales.view(torch.uint8)

    def _checked(self, name: str) -> tuple[TensorSpec, dict[str, torch.Tensor]]:
        """The spec and stored parts of a logical tensor, after the value checks (scan.py)."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"{name}: not a tensor of this checkpoint")
        parts = self._stored(spec)
        for finding in self._scan(parts):
            if finding.level == "error":
                entry = self.entries[finding.tensor]
                raise CheckpointError(f"tensor {finding.tensor} in {entry.file}: {finding.message}")
        return spec, parts

    def _stored(self, spec: TensorSpec) -> dict[str, torch.Tensor]:
        names = [spec.name] if spec.kind in ("bf16", "fp32", "int32") else [f"{spec.name}.weight", f"{spec.name}.scale"]
        return {n: self.raw(n) for n in names}

    def _scan(self, parts: dict[str, torch.Tensor]) -> list[Finding]:
        return [f for n, t in parts.items() for f in scan(n, t, n_experts=self.config.n_routed_experts)]

    def findings(self) -> list[Finding]:
        """Every value finding (errors and warnings) over the whole checkpoint; reads every tensor."""
        return [f for spec in self.specs.values() for f in self._scan(self._stored(spec))]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All logical tensors, dequantised (for small models and tests)."""
        return {name: self.get(name) for name in self.specs}


# ---- writer ---------------------------------------------------------------------------------------

def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def random_tensor(cfg: ModelConfig, spec: TensorSpec, seed: int) -> torch.Tensor:
    """A plausible random value for a logical tensor (deterministic in (seed, name))."""
    return _draw(cfg, spec, _generator(seed, spec.name), spec.shape)


def _draw(cfg: ModelConfig, spec: TensorSpec, g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """``shape``'s worth of ``spec``'s random value from ``g``: the whole tensor, or its next rows."""
    name, device = spec.name, g.device  # drawn where the generator lives (random_weights.py: a GPU)
    normal = lambda std: torch.randn(shape, generator=g, device=device) * std
    if name.endswith("tid2eid"):
        return torch.rand(shape[0], cfg.n_routed_experts, generator=g, device=device).argsort(-1)[:, : shape[1]].int()
    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return 1.0 + normal(0.1)
    if name.endswith(("_fn",)):
        return normal(0.02)
    if name.endswith(("_base",)):
        return normal(0.1)
    if name.endswith("_scale") and spec.kind == "fp32":
        return 1.0 + normal(0.1)
    if name.endswith(("attn_sink", "gate.bias", "gate.bias_vl", "ape")):
        return normal(0.5)
    if name == "embed.weight" or name.endswith("engram.embed"):
        return normal(1.0)
    return normal(spec.shape[-1] ** -0.5)


def stored_tensors(cfg: ModelConfig, spec: TensorSpec, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Encode a logical value into its safetensors entries."""
    if spec.kind == "fp8":
        q, s = quant.quantize_fp8_blocks(value, cfg.weight_block_size[0])
        yield f"{spec.name}.weight", q
        yield f"{spec.name}.scale", s
    elif spec.kind == "fp4":
        q, s = quant.quantize_fp4_rows(value)
        yield f"{spec.name}.weight", q
        yield f"{spec.name}.scale", s
    elif spec.kind == "fp8row":
        q, s = quant.quantize_fp8_rows(value)
        yield f"{spec.name}.weight", q
        yield f"{spec.name}.scale", s
    else:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32}[spec.kind]
        yield spec.name, value.to(dtype).contiguous()


CHUNK_ELEMENTS = 1 << 22  # a large tensor is drawn and encoded this many values at a time


def chunk_rows(cfg: ModelConfig, spec: TensorSpec, limit: int = CHUNK_ELEMENTS) -> int:
    """Rows of ``spec`` drawn at once: every row where the tensor is small; else a multiple of the
    FP8 block (whole scale rows) of at most ``limit`` values, and a multiple of 16 values, so that
    torch's normal draws in turn give the values one draw of the whole tensor gives (its sampler
    works in groups of 16). The random tid2eid table is drawn whole."""
    rows, per_row = spec.shape[0], math.prod(spec.shape[1:])
    if rows * per_row <= limit or len(spec.shape) < 2 or spec.name.endswith("tid2eid"):
        return rows
    unit = cfg.weight_block_size[0] if spec.kind == "fp8" else 1
    while unit * per_row % 16:
        unit *= 2
    n = max(unit, limit // per_row // unit * unit)
    last = rows % n
    return n if last == 0 or last * per_row >= 16 else rows


def _stored_value(cfg: ModelConfig, spec: TensorSpec, seed: int, limit: int) -> dict[str, torch.Tensor]:
    """The safetensors entries of one logical tensor, drawn and encoded ``chunk_rows`` at a time into
    tensors of their stored size (FP8 / FP4 codes and scales, never the whole FP32 value at once)."""
    block = cfg.weight_block_size[0]
    n = chunk_rows(cfg, spec, limit)
    if n == spec.shape[0]:
        return dict(stored_tensors(cfg, spec, random_tensor(cfg, spec, seed)))
    out = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in spec.stored(block).items()}
    g = _generator(seed, spec.name)
    for r in range(0, spec.shape[0], n):
        rows = min(n, spec.shape[0] - r)
        piece = TensorSpec(spec.name, (rows, *spec.shape[1:]), spec.kind)
        for name, part in stored_tensors(cfg, piece, _draw(cfg, spec, g, piece.shape)):
            at = r // block if spec.kind == "fp8" and name.endswith(".scale") else r
            out[name][at: at + part.shape[0]] = part
    return out


def shard_plan(cfg: ModelConfig, max_shard_bytes: int) -> list[list[str]]:
    """The stored tensor names of each shard, in order, from their sizes alone (nothing drawn): a new
    shard starts where the next tensor would pass ``max_shard_bytes`` (a tensor larger than that
    gets a shard of its own)."""
    shards, size = [[]], 0
    for spec in tensor_specs(cfg):
        for name, (shape, dtype) in spec.stored(cfg.weight_block_size[0]).items():
            nbytes = math.prod(shape) * dtype.itemsize
            if size and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
    return shards


def write_random_checkpoint(cfg: ModelConfig, path: str | Path, *, seed: int = 0,
                            max_shard_bytes: int = 16 << 20, chunk_elements: int = CHUNK_ELEMENTS) -> Path:
    """Write config.json, shards `model-0000k-of-0000n.safetensors` and their index; return the path.
    Streams: a shard is written, and let go, as soon as its last tensor is drawn, so memory holds one
    shard and one logical tensor's stored bytes (a real-dimension layer's experts are 7.5 GB)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(cfg, max_shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors" for k in range(len(plan))]
    shard_of = {name: k for k, shard in enumerate(plan) for name in shard}
    pending: dict[str, torch.Tensor] = {}
    done, total = 0, 0
    for spec in tensor_specs(cfg):
        pending.update(_stored_value(cfg, spec, seed, chunk_elements))
        while done < len(plan) and all(name in pending for name in plan[done]):
            shard = {name: pending.pop(name) for name in plan[done]}
            total += sum(t.numel() * t.element_size() for t in shard.values())
            save_file(shard, str(path / names[done]), metadata={"format": "pt"})
            done += 1
    weight_map = {name: names[k] for name, k in shard_of.items()}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=1, sort_keys=True))
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    return path
