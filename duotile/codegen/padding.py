"""A kernel's ``padded`` sizes (``@dsl.kernel(padded={"L": fill})``): a call's tensors are padded
along them to the size's power-of-two bucket with the fill, so a size that grows during a
generation (top-k's row length, a row a decode step) takes one build a bucket, not one a value."""

from __future__ import annotations

from typing import Any

import torch

from ..dsl.errors import DslError
from ..dsl.ir import Module
from ..dsl.kernel import KernelDef, bucket


def pad_call(kernel: KernelDef, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` with each one that carries a padded size padded along it (a new tensor, the
    call's values first, then the fill) where the size is not its own bucket."""
    out = dict(tensors)
    for dim, fill in kernel.padded:
        for name, spec in kernel.tensors.items():
            t = out.get(name)
            if t is None or dim not in spec.dims or not hasattr(t, "shape"):
                continue
            axis = spec.dims.index(dim)
            n = int(t.shape[axis])
            if n == bucket(n):
                continue
            shape = list(t.shape)
            shape[axis] = bucket(n)
            wide = torch.full(shape, fill, dtype=t.dtype, device=t.device)
            wide.narrow(axis, 0, n).copy_(t)
            out[name] = wide
    return out


def check_reads_only(kernel: KernelDef, phases: list[Module]) -> None:
    """A padded tensor is a copy: a kernel that wrote one would write the copy. Refused, naming the
    store's line."""
    carriers = {name for dim, _ in kernel.padded for name, spec in kernel.tensors.items() if dim in spec.dims}
    for module in phases:
        for op in module.walk():
            if op.name in ("store", "scatter") and op.attrs["tensor"] in carriers:
                raise DslError(f"{kernel.name}: tensor {op.attrs['tensor']!r} carries a padded size and is written "
                               "by the kernel; only tensors it reads may be padded", op.loc)
