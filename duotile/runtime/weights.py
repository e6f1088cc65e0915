"""Sharded safetensors checkpoints: a validating lazy reader and a random-checkpoint writer.

`Checkpoint.open(path)` reads `config.json`, the index (`model.safetensors.index.json`, or a single
`model.safetensors`) and every shard's header - not the data. It checks, before anything is used, that
each tensor of the inventory (inventory.py) is present with the right dtype and shape and that its bytes
lie inside its file; any problem raises `CheckpointError` naming the tensor and the file. Tensor data is
read lazily through safetensors' memory map, and `Checkpoint.get(name)` returns the dequantised FP32
value (FP8 x UE8M0 block scale, packed FP4 x UE8M0 per 32). Every such product is exact in FP32 and in
BF16, so dequantising loses nothing.

`write_random_checkpoint(cfg, path)` produces a valid checkpoint for any config: random weights scaled
so activations stay O(1), quantised to the released storage formats, split into shards with an index.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import quant
from .config import ModelConfig
from .inventory import TensorSpec, tensor_specs

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
              "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32, "I64": torch.int64,
              "F16": torch.float16, "U8": torch.uint8}


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated or inconsistent; the message names the tensor and the file."""


@dataclass(frozen=True, slots=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, _Entry]:
    """Parse one safetensors header and check that every tensor's bytes lie inside the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated file (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated file (header of {n} bytes, file has {size})")
            header = json.loads(fh.read(n))
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err}") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: corrupt safetensors header: {err}") from err
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name} in {path}: unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        if 8 + n + end > size:
            raise CheckpointError(f"tensor {name} in {path}: truncated file (data ends at byte {8 + n + end}, "
                                  f"file has {size})")
        shape = tuple(info["shape"])
        numel = 1
        for dim in shape:
            numel *= dim
        if end - begin != numel * dtype.itemsize:
            raise CheckpointError(f"tensor {name} in {path}: {end - begin} bytes for shape {shape} {info['dtype']}")
        entries[name] = _Entry(path, dtype, shape)
    return entries


class Checkpoint:
    """A validated, lazily read checkpoint directory."""

    def __init__(self, path: Path, config: ModelConfig, entries: dict[str, _Entry]):
        self.path, self.config, self.entries = path, config, entries
        self.specs = {s.name: s for s in tensor_specs(config)}
        self._handles: dict[Path, object] = {}

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json (not a checkpoint directory)")
        config = ModelConfig.from_file(path / "config.json")
        entries: dict[str, _Entry] = {}
        for shard in _shards(path):
            entries.update(read_header(shard))
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
        """The dequantised value of a logical tensor (FP32; integer tables stay integer)."""
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"{name}: not a tensor of this checkpoint")
        if spec.kind == "fp8":
            return quant.dequantize_fp8_blocks(self.raw(f"{name}.weight"), self.raw(f"{name}.scale"),
                                               self.config.weight_block_size[0])
        if spec.kind == "fp4":
            return quant.dequantize_fp4_rows(self.raw(f"{name}.weight"), self.raw(f"{name}.scale"))
        if spec.kind == "fp8row":
            return quant.dequantize_fp8_rows(self.raw(f"{name}.weight"), self.raw(f"{name}.scale"))
        value = self.raw(name)
        return value.long() if spec.kind == "int32" else value.float()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All logical tensors, dequantised (for small models and tests)."""
        return {name: self.get(name) for name in self.specs}


def _shards(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: corrupt index ({err})") from err
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            tensor = next(t for t, f in weight_map.items() if f == missing[0])
            raise CheckpointError(f"tensor {tensor}: its shard {path / missing[0]} is missing")
        return [path / f for f in files]
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME]
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


# ---- writer ---------------------------------------------------------------------------------------

def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def random_tensor(cfg: ModelConfig, spec: TensorSpec, seed: int) -> torch.Tensor:
    """A plausible random value for a logical tensor (deterministic in (seed, name))."""
    g, name, shape = _generator(seed, spec.name), spec.name, spec.shape
    normal = lambda std: torch.randn(shape, generator=g) * std
    if name.endswith("tid2eid"):
        return torch.rand(shape[0], cfg.n_routed_experts, generator=g).argsort(-1)[:, : shape[1]].int()
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
    return normal(shape[-1] ** -0.5)


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


def write_random_checkpoint(cfg: ModelConfig, path: str | Path, *, seed: int = 0,
                            max_shard_bytes: int = 16 << 20) -> Path:
    """Write config.json, shards `model-0000k-of-0000n.safetensors` and their index; return the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for spec in tensor_specs(cfg):
        for name, tensor in stored_tensors(cfg, spec, random_tensor(cfg, spec, seed)):
            nbytes = tensor.numel() * tensor.element_size()
            if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][name] = tensor
            sizes[-1] += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (path / INDEX_NAME).write_text(json.dumps(index, indent=1, sort_keys=True))
    (path / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    return path
