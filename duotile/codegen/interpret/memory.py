"""The interpreter's memory ops: loads, gathers, stores and scatters at each program's corner (a
window copy a distinct corner, or index tensors where the corners are many), and buffers."""

from __future__ import annotations

import math

import torch

from ...dsl.ir import Op
from .machine import Interpreter, handles, lift, programs_of

WINDOWS_AT_ONCE = 64  # up to this many distinct corners, a memory op copies windows; more, it indexes
SMALL_TILE = 1024  # ... but a tile smaller than this copies windows only up to SMALL_WINDOWS corners
SMALL_WINDOWS = 16


def _uniform(offsets) -> bool:
    return not any(isinstance(o, torch.Tensor) for o in offsets)


def _window_at(offsets: list[int], shape: list[int], tensor: torch.Tensor):
    """Slices of ``tensor`` covered by the tile at one corner (clipped), and where they sit in it."""
    lead = tensor.dim() - len(shape)
    src, dst = [], []
    for d, off in enumerate(offsets):
        size = tensor.shape[d]
        if d < lead:
            if not 0 <= off < size:
                return None, None
            src.append(off)
            continue
        n = shape[d - lead]
        lo, hi = max(off, 0), min(off + n, size)
        if hi <= lo:
            return None, None
        src.append(slice(lo, hi))
        dst.append(slice(lo - off, hi - off))
    return tuple(src), tuple(dst)


def _indices(it: Interpreter, tensor: torch.Tensor, offsets: list, shape: list[int], axis: int | None = None,
             picked: torch.Tensor | None = None):
    """Index tensors into ``tensor`` for every element of the tile at each program's corner
    (broadcasting to (P, *shape)), clamped into the tensor, and the mask of the elements inside
    it; with ``axis``, that axis takes the per-program positions ``picked`` (P, n) instead."""
    rank, lead = len(shape), tensor.dim() - len(shape)
    idx, inside = [], None
    for d in range(tensor.dim()):
        size = tensor.shape[d]
        if d == axis:
            view = [1] * rank
            view[d - lead] = -1
            i = picked.view(picked.shape[0], *view)
        else:
            i = torch.as_tensor(offsets[d], device=it.device).view(-1, *([1] * rank))
            if d >= lead:
                view = [1] * rank
                view[d - lead] = shape[d - lead]
                i = i + torch.arange(shape[d - lead], device=it.device).view(view)
        ok = (i >= 0) & (i < size)
        idx.append(i.clamp(0, max(size - 1, 0)))
        inside = ok if inside is None else inside & ok
    return tuple(idx), inside


def _corners(it: Interpreter, offsets: list) -> list[tuple]:
    """Each program's corner, as ints."""
    cols = [o.tolist() if isinstance(o, torch.Tensor) else [o] * it.P for o in offsets]
    return list(zip(*cols))


def _by_windows(corners: int, elements: int) -> bool:
    """Whether copying a window a corner beats index tensors: a copy costs a few microseconds
    whatever its size, index tensors a fixed hundred or so plus their elements."""
    return corners <= (WINDOWS_AT_ONCE if elements >= SMALL_TILE else min(SMALL_WINDOWS, WINDOWS_AT_ONCE))


def _window_read(source: torch.Tensor, corner, shape: list[int], other, dtype, device) -> torch.Tensor:
    out = torch.full(shape, other, dtype=dtype, device=device)
    src, dst = _window_at(list(corner), shape, source)
    if src is not None:
        out[dst] = source[src]
    return out


def _read(it: Interpreter, op: Op, source: torch.Tensor, offsets: list, axis=None, picked=None) -> torch.Tensor:
    """The tile at each program's corner of ``source`` (``axis`` gathered by ``picked``); what lies
    outside it reads ``other``. A few distinct corners are read as windows, one each; many, or a
    gather, by index tensors."""
    t = op.result.type
    shape, full = [int(d) for d in op.attrs["shape"]], [int(d) for d in t.shape]
    dtype, other = t.dtype.torch, op.attrs["other"]
    if axis is None and _uniform(offsets):
        return _window_read(source, offsets, shape, other, dtype, it.device).reshape(1, *full)
    if axis is None:
        corners = _corners(it, offsets)
        distinct: dict[tuple, int] = {}
        which = [distinct.setdefault(c, len(distinct)) for c in corners]
        if _by_windows(len(distinct), math.prod(shape)):
            out = torch.stack([_window_read(source, c, shape, other, dtype, it.device) for c in distinct])
            if len(distinct) < len(corners):
                out = out[torch.tensor(which, device=it.device)]
            return out.reshape(len(corners), *full)
    if 0 in source.shape:
        p = 1 if picked is None else picked.shape[0]
        return torch.full([p, *full], other, dtype=dtype, device=it.device)
    idx, inside = _indices(it, source, offsets, shape, axis, picked)
    out = torch.where(inside, source[idx], torch.tensor(other, dtype=dtype, device=it.device))
    return out.reshape(programs_of(out), *full)


@handles("load")
def _load(it: Interpreter, op: Op):
    offsets = [it.scalar(o) for o in op.attrs["offsets"]]
    it.put(op.result, _read(it, op, it.tensors[op.attrs["tensor"]], offsets))


@handles("gather")
def _gather(it: Interpreter, op: Op):
    """The gathered axis picks rows by index; the other axes read like a load from those rows."""
    tensor = it.tensors[op.attrs["tensor"]]
    offsets = [it.scalar(o) for o in op.attrs["offsets"]]
    idx = it.get(op.args[0])
    picked = idx.reshape(programs_of(idx), -1).long()
    it.put(op.result, _read(it, op, tensor, offsets, op.attrs["axis"], picked))


def _write(it: Interpreter, tensor: torch.Tensor, value: torch.Tensor, offsets: list, shape: list[int],
           axis=None, picked=None):
    """``value`` (P or 1, *shape) into ``tensor`` at each running program's corner; elements
    outside the tensor are dropped."""
    rank = len(shape)
    value = torch.broadcast_to(lift(value, rank), [programs_of(value), *shape]).to(tensor.dtype)
    if axis is None and _uniform(offsets):  # one corner: the last running program's tile lands
        src, dst = _window_at(offsets, shape, tensor)
        if src is None:
            return
        last = value.shape[0] - 1 if it.active is None or value.shape[0] == 1 else \
            int(torch.nonzero(it.active).max())
        tensor[src] = value[last][dst]
        return
    if axis is None and _by_windows(it.P, math.prod(shape)):  # program by program, in order
        for p, corner in enumerate(_corners(it, offsets)):
            if it.active is None or bool(it.active[p]):
                src, dst = _window_at(list(corner), shape, tensor)
                if src is not None:
                    tensor[src] = value[p if value.shape[0] > 1 else 0][dst]
        return
    if 0 in tensor.shape:
        return
    idx, inside = _indices(it, tensor, offsets, shape, axis, picked)
    running = it.mask(rank)
    sel = inside if running is None else inside & running
    full = torch.broadcast_shapes(sel.shape, value.shape, *(i.shape for i in idx))
    sel = sel.expand(full)
    tensor[tuple(i.expand(full)[sel] for i in idx)] = value.expand(full)[sel]


@handles("store")
def _store(it: Interpreter, op: Op):
    tensor = it.tensors[op.attrs["tensor"]]
    shape = [int(d) for d in op.attrs["shape"]]
    value = it.get(op.args[0])
    value = value.reshape(programs_of(value), *shape)
    _write(it, tensor, value, [it.scalar(o) for o in op.attrs["offsets"]], shape)


@handles("scatter")
def _scatter(it: Interpreter, op: Op):
    """Row r of the tile goes to the index ``idx[r]`` names along the scattered axis; the other
    axes clip like a store's; a row whose index is < 0 or >= the size is dropped."""
    tensor = it.tensors[op.attrs["tensor"]]
    shape = [int(d) for d in op.attrs["shape"]]
    idx = it.get(op.args[1])
    picked = idx.reshape(programs_of(idx), -1).long()
    _write(it, tensor, it.get(op.args[0]), [it.scalar(o) for o in op.attrs["offsets"]], shape,
           op.attrs["axis"], picked)


@handles("alloc")
def _alloc(it: Interpreter, op: Op):
    t = op.result.type
    fill = op.attrs["fill"]
    fill = float("nan") if fill is None and t.dtype.is_float else (fill or 0)
    it.put(op.result, torch.full([it.P, *[int(d) for d in t.shape]], fill, dtype=t.dtype.torch, device=it.device))


@handles("assign")
def _assign(it: Interpreter, op: Op):
    it.overwrite(it.get(op.args[0]), it.get(op.args[1]))
