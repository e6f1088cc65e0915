"""Strict reading of safetensors headers and of the shard index, before any tensor byte is read.

A header is refused (`CheckpointError` naming the file and the tensor) when it is not a JSON object,
repeats a key, has an entry without a known dtype, a shape that is not a list of non-negative
integers, or offsets that are not two integers `0 <= begin <= end`; when a tensor's byte count does
not match its shape and dtype; when two tensors' byte ranges overlap (aliased offsets included); and
when the tensors do not cover the data area exactly - a gap, or bytes appended after the last tensor.
The index must map tensor names to plain shard file names; a tensor listed in two shards, found in a
shard other than the one the index names, or missing from the shard the index names is refused too.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
             "BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32, "I64": torch.int64,
             "F16": torch.float16, "U8": torch.uint8}


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated or inconsistent; the message names the tensor and the file."""


@dataclass(frozen=True, slots=True)
class Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int = 0
    end: int = 0


def _no_duplicates(where: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointError(f"{where}: duplicate entry {key!r}")
            out[key] = value
        return out

    return hook


def _load_json(text: str | bytes, where: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(where))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{where}: corrupt JSON: {err}") from err


def _is_nat(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry(path: Path, name: str, info: Any) -> Entry:
    where = f"tensor {name} in {path}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise CheckpointError(f"{where}: header entry has no {key}")
    dtype = ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CheckpointError(f"{where}: unsupported dtype {info['dtype']!r}")
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_nat(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative integers")
    offsets = info["data_offsets"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_nat(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not two integers 0 <= begin <= end")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize:
        raise CheckpointError(f"{where}: {end - begin} bytes for shape {tuple(shape)} {info['dtype']}")
    return Entry(path, dtype, tuple(shape), begin, end)


def read_header(path: Path) -> dict[str, Entry]:
    """Parse one safetensors header strictly (see the module doc); nothing past the header is read."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated file (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated file (header of {n} bytes, file has {size})")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
            raw = fh.read(n)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err}") from err
    header = _load_json(raw, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: __metadata__ must map names to strings")
    entries = {name: _entry(path, name, info) for name, info in header.items() if name != "__metadata__"}
    _check_layout(path, entries, size - 8 - n)
    return entries


def _check_layout(path: Path, entries: dict[str, Entry], data_len: int) -> None:
    """Byte ranges inside the data area, disjoint, and covering it with no gap or tail."""
    at, last = 0, None
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.end > data_len:
            raise CheckpointError(f"tensor {name} in {path}: truncated file (data ends at byte {e.end}, the data "
                                  f"area has {data_len})")
        if e.begin == e.end:
            continue
        if e.begin < at:
            raise CheckpointError(f"tensor {name} in {path}: bytes {e.begin}..{e.end} overlap tensor {last} "
                                  f"(ending at {at})")
        if e.begin > at:
            raise CheckpointError(f"tensor {name} in {path}: bytes {at}..{e.begin} before it belong to no tensor")
        at, last = e.end, name
    if at != data_len:
        after = f" after tensor {last}" if last else ""
        raise CheckpointError(f"{path}: {data_len - at} bytes{after} belong to no tensor (data area {data_len} "
                              f"bytes, tensors end at {at}): appended or corrupt data")


def read_index(path: Path) -> dict[str, str]:
    """The index's weight_map (tensor -> shard file name), strictly checked."""
    index = path / INDEX_NAME
    try:
        text = index.read_text()
    except OSError as err:
        raise CheckpointError(f"{index}: cannot read: {err}") from err
    raw = _load_json(text, str(index))
    if not isinstance(raw, dict) or "weight_map" not in raw:
        raise CheckpointError(f"{index}: corrupt index (no weight_map object)")
    weight_map = raw["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: weight_map is a {type(weight_map).__name__}, expected an object "
                              "mapping tensor names to shard files")
    for tensor, fname in weight_map.items():
        if not (isinstance(fname, str) and fname.endswith(".safetensors") and Path(fname).name == fname
                and fname not in (".", "..")):
            raise CheckpointError(f"tensor {tensor}: {index} maps it to {fname!r}, not a shard file name in "
                                  "the checkpoint directory")
    return weight_map


def read_all_headers(path: Path) -> dict[str, Entry]:
    """Every tensor's header entry across the shards, consistent with the index."""
    if (path / INDEX_NAME).is_file():
        weight_map = read_index(path)
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            tensor = next(t for t, f in weight_map.items() if f == missing[0])
            raise CheckpointError(f"tensor {tensor}: its shard {path / missing[0]} is missing")
    elif (path / SINGLE_NAME).is_file():
        weight_map, files = None, [SINGLE_NAME]
    else:
        raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
    entries: dict[str, Entry] = {}
    for fname in files:
        for name, entry in read_header(path / fname).items():
            if name in entries:
                raise CheckpointError(f"tensor {name}: in two shards, {entries[name].file} and {entry.file}")
            if weight_map is not None and weight_map.get(name) != fname:
                listed = weight_map.get(name)
                said = f"the index puts it in {listed}" if listed else "the index does not list it"
                raise CheckpointError(f"tensor {name} in {entry.file}: {said}")
            entries[name] = entry
    if weight_map is not None:
        absent = [t for t in weight_map if t not in entries]
        if absent:
            raise CheckpointError(f"tensor {absent[0]}: missing from {path / weight_map[absent[0]]}, the shard "
                                  "the index puts it in")
    return entries
