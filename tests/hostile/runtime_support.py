"""Helpers for the runtime's hostile-input tests: one tiny checkpoint per preset per test run, copies to
corrupt, and raw safetensors header surgery."""

from __future__ import annotations

import atexit
import json
import shutil
import struct
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from duotile.runtime.presets import get_preset
from duotile.runtime.weights import INDEX_NAME, write_random_checkpoint

_ROOT = Path(tempfile.mkdtemp(prefix="duotile-hostile-"))
atexit.register(shutil.rmtree, _ROOT, True)
_WRITTEN: dict[str, Path] = {}


def tiny(name: str = "v4-tiny") -> Path:
    """A pristine tiny checkpoint (written once per process; never modify it, copy it)."""
    if name not in _WRITTEN:
        _WRITTEN[name] = write_random_checkpoint(get_preset(name), _ROOT / name, seed=11)
    return _WRITTEN[name]


def copy_of(name: str, dst: Path) -> Path:
    shutil.copytree(tiny(name), dst)
    return dst


def shard_of(path: Path, tensor: str) -> Path:
    return path / json.loads((path / INDEX_NAME).read_text())["weight_map"][tensor]


def rewrite_tensor(path: Path, tensor: str, fn) -> Path:
    """Replace one stored tensor by fn(tensor) in its shard; returns the shard."""
    shard = shard_of(path, tensor)
    tensors = load_file(str(shard))
    tensors[tensor] = fn(tensors[tensor].clone())
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard


def read_raw(file: Path) -> tuple[dict, bytes]:
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw(file: Path, header: dict | str, body: bytes) -> None:
    text = header if isinstance(header, str) else json.dumps(header)
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
