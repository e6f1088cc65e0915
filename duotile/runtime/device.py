"""Resolve a device name (`cpu`, `cuda`, `cuda:1`, `npu`, `npu:0`, `mps`) into a usable `torch.device`.

A device that this machine does not have is refused with one sentence that says which devices it
does have, before any weight is moved. `npu` (Ascend) works where `torch_npu` imports; without it
the message says that the package is missing.
"""

from __future__ import annotations

import importlib

import torch


class DeviceError(ValueError):
    """The requested device does not exist here; the message lists those that do."""


def _npu_module():
    """torch_npu's device module, or None when torch_npu is not installed (or does not import)."""
    try:
        importlib.import_module("torch_npu")
    except Exception:  # noqa: BLE001 - an installed-but-broken torch_npu is just as absent
        return None
    return getattr(torch, "npu", None)


def _count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "npu":
        npu = _npu_module()
        return npu.device_count() if npu is not None and npu.is_available() else 0
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return 1 if mps is not None and mps.is_available() else 0
    return 0


def available_devices() -> list[str]:
    """Every device name this machine can run on, `cpu` first."""
    names = ["cpu"]
    for kind in ("cuda", "npu", "mps"):
        n = _count(kind)
        names += [kind] if kind == "mps" and n else [f"{kind}:{i}" for i in range(n)]
    return names


def resolve_device(name: str | torch.device) -> torch.device:
    """A `torch.device` for `name`, or DeviceError naming the devices that exist."""
    text = str(name).strip().lower()
    kind, _, index_text = text.partition(":")
    have = ", ".join(available_devices())
    if kind not in ("cpu", "cuda", "npu", "mps"):
        raise DeviceError(f"device: unknown device {str(name)!r}; this machine has {have}")
    if index_text and not index_text.isdigit():
        raise DeviceError(f"device: bad device index in {str(name)!r}; this machine has {have}")
    index = int(index_text) if index_text else None
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "npu" and _npu_module() is None:
        raise DeviceError(f"device: {text} needs the torch_npu package (Ascend), which is not installed; "
                          f"this machine has {have}")
    count = _count(kind)
    if count == 0:
        why = {"cuda": "PyTorch sees no CUDA GPU" + ("" if torch.version.cuda else " (this is a CPU-only build)"),
               "npu": "torch_npu sees no Ascend NPU", "mps": "no Apple GPU is available"}[kind]
        raise DeviceError(f"device: {text} is not available: {why}; this machine has {have}")
    if index is not None and index >= count:
        raise DeviceError(f"device: {text} does not exist ({count} {kind} device(s)); this machine has {have}")
    try:
        return torch.device(kind, index if index is not None else 0) if kind != "mps" else torch.device("mps")
    except RuntimeError as err:  # e.g. a torch_npu that did not register the npu device type
        raise DeviceError(f"device: PyTorch does not accept {text!r} ({err}); this machine has {have}") from err


def ship(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor (indices, positions: what the host knows of a step) on ``device``, queued
    without waiting for the GPU: a blocking copy to a GPU waits for the work queued before it, a
    wait inside every decode step."""
    return t.to(device, non_blocking=True)


def ints(values, device: torch.device | str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A list of host integers as a tensor on ``device`` (``ship``)."""
    return ship(torch.tensor(values, dtype=dtype), device)
