"""Executes a bound Tile IR module with PyTorch on CPU or GPU, the programs of a grid together.

Semantics, for every target to match:
- ``load`` reads the tile at its corner; elements outside the tensor read ``other``.
- ``gather`` reads rows named by an index tile; an index < 0 or >= the size reads ``other``.
- ``store`` writes the tile; elements outside the tensor are dropped.
- ``scatter`` writes the tile's rows to the rows an index tile names; a row whose index is < 0 or
  >= the size is dropped (as are elements outside the tensor along the other axes).
- ``gemm`` adds ``a @ b`` (with transposes) to an fp32 buffer, products and sums in fp32.
- elementwise math runs in the result dtype of the op (fp32 for the specs' math).
- ``/`` divides floats (the tracer converts integer operands); ``//`` and ``%`` on integers
  floor like Python's (``-7 // 2 == -4``, ``-7 % 2 == 1``); a zero divisor gives 0 for ``//``
  and the dividend for ``%``, so ``(a // b) * b + a % b == a`` holds for every b.
- ``& | ^`` on integers act on two's complement bits; ``<<`` by a constant drops the bits shifted
  out of the type, ``>>`` is arithmetic on signed types and logical on ``u8``; ``bitcast`` reads
  the same bits as another type of the width (``f32 <-> i32``), NaN payloads included.
- programs of one grid do not see each other's writes in a defined order: two programs writing
  one element leave one of the values, which one unspecified (as on a GPU).

**Programs together.** A batch of programs runs as one: every tile value carries a leading program
axis (of size P, or 1 where the value is the same in every program), a scalar (a program id, a value
read by ``dsl.scalar``) is a Python int where it is the same in every program and a tensor of P ints
where it is not. Memory ops at per-program corners copy a window a distinct corner, or use index
tensors where the corners are many (``memory.py``). A loop whose bounds differ by program runs from
the least start to the greatest end with a mask of the programs inside their range; a masked
program's stores, assigns and gemms do nothing. What a program computes never depends on P or on the
others in its batch: the ops whose fp32 results depend on the layout torch gives them (sums of
floats, gemms, and the transcendental functions, whose vector and scalar paths differ in the last
bit) run program by program on a contiguous tile of the program's own shape; the rest are exact
elementwise.
"""

from __future__ import annotations

import math

import sympy
import torch

from ...dsl.ir import Block, Module, Op, Value
from ..handlers import OpHandlers
from .scalars import integer_form, python_form

HANDLERS = OpHandlers()
handles = HANDLERS.on

ELEMENTS_AT_ONCE = 1 << 20  # the programs of a batch hold at most this many elements in their largest tile


def lift(t, rank: int):
    """``t`` with the leading program axis and ``rank`` tile axes (size-1 axes inserted after the
    program axis, as broadcasting would put them before the tile's own); numbers and 0-d tensors
    as they are."""
    if not isinstance(t, torch.Tensor) or t.dim() in (0, rank + 1):
        return t
    return t.view(t.shape[0], *([1] * (rank + 1 - t.dim())), *t.shape[1:])


def programs_of(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


class Interpreter:
    def __init__(self, module: Module, tensors: dict[str, torch.Tensor]):
        self.module = module
        self.tensors = tensors
        self.env: dict[str, object] = {}
        self.sizes = module.dynamic_sizes(tensors)  # the call's value of each dynamic size
        self.vals: dict[int, torch.Tensor] = {}
        self.device = next(iter(t.device for t in tensors.values() if t is not None))
        self.P = 1  # programs in the batch running now
        self.active: torch.Tensor | None = None  # which of them run the ops now (None: all)

    # -- scalars ------------------------------------------------------------------------------
    def scalar(self, e):
        """An index expression's value: a number where it is the same in every program of the
        batch, else a tensor of the P values."""
        if not isinstance(e, sympy.Basic):
            return e
        fn, names = python_form(e)
        if fn is None:
            return names
        args = [self.env[n] for n in names]
        if not any(isinstance(a, torch.Tensor) for a in args):
            return fn(*args)
        whole = integer_form(e)
        if whole is not None:
            return torch.as_tensor(whole(self.env), device=self.device).expand(self.P)
        cols = [a.tolist() if isinstance(a, torch.Tensor) else [a] * self.P for a in args]
        vals = [fn(*row) for row in zip(*cols)]
        exact = all(isinstance(v, int) for v in vals)
        return torch.tensor(vals, dtype=torch.int64 if exact else torch.float64, device=self.device)

    def get(self, v, rank: int = 0):
        """A value (with its program axis), or an expression's value lifted to ``rank`` tile axes."""
        if isinstance(v, Value):
            return self.vals[v.id]
        s = self.scalar(v)
        return s.view(-1, *([1] * rank)) if isinstance(s, torch.Tensor) else s

    def put(self, v: Value, t: torch.Tensor):
        self.vals[v.id] = t

    def mask(self, rank: int) -> torch.Tensor | None:
        """The running programs as a (P, 1, ...) mask of ``rank`` tile axes, or None for all."""
        return None if self.active is None else self.active.view(-1, *([1] * rank))

    def overwrite(self, dst: torch.Tensor, src) -> None:
        """``dst`` (a buffer) takes ``src`` in the running programs."""
        src = torch.broadcast_to(lift(src, dst.dim() - 1), dst.shape) if isinstance(src, torch.Tensor) else src
        running = self.mask(dst.dim() - 1)
        if running is None:
            dst.copy_(src)
        else:
            dst.copy_(torch.where(running, torch.as_tensor(src, dtype=dst.dtype, device=dst.device), dst))

    # -- control ------------------------------------------------------------------------------
    def run(self):
        grid = self.module.grid
        names = [str(v) for v in grid.attrs["vars"]]
        self.env = dict(self.sizes)
        extents = [int(self.scalar(e)) for e in grid.attrs["extents"]]
        total = math.prod(extents)
        at_once = max(1, ELEMENTS_AT_ONCE // _largest_tile(grid.regions[0]))
        for first in range(0, total, at_once):
            self.P = min(at_once, total - first)
            flat = torch.arange(first, first + self.P, device=self.device)
            point, stride = {}, 1
            for name, n in reversed(list(zip(names, extents))):  # the last axis fastest, as nested loops
                coord = (flat // stride) % n
                point[name] = int(coord[0]) if self.P == 1 else coord
                stride *= n
            self.env = {**self.sizes, **point}
            self.vals = {}
            self.active = None
            self.block(grid.regions[0])

    def block(self, block: Block):
        for op in block.ops:
            handler = HANDLERS.get(op.name)
            if handler is None:
                from ...dsl.errors import UnsupportedError

                raise UnsupportedError(f"the interpreter has no handler for {op.name}", op.loc)
            handler(self, op)


def _largest_tile(block: Block) -> int:
    """Elements of the largest tile the body makes (at least 1)."""
    sizes = [1]
    for op in block.walk():
        if op.result is not None:
            sizes.append(math.prod(int(d) for d in op.result.type.shape))
    return max(sizes)


def run_module(module: Module, tensors: dict[str, torch.Tensor]) -> None:
    Interpreter(module, tensors).run()


def _column(t: torch.Tensor):
    """The first element of each program's tile: an int, or a tensor of P ints."""
    col = t.reshape(programs_of(t), -1)[:, 0].long()
    return int(col[0]) if col.numel() == 1 else col


@handles("for")
def _for(it: Interpreter, op: Op):
    var = str(op.attrs["var"])
    start, end = it.scalar(op.attrs["start"]), it.scalar(op.attrs["extent"])
    if op.args:  # a stop read from data: the loop ends at the smaller of the two
        stop = _column(it.get(op.args[0]))
        end = min(end, stop) if not isinstance(stop, torch.Tensor) and not isinstance(end, torch.Tensor) \
            else torch.minimum(torch.as_tensor(end, device=it.device), torch.as_tensor(stop, device=it.device))
    if not isinstance(start, torch.Tensor) and not isinstance(end, torch.Tensor):
        for i in range(int(start), int(end)):
            it.env[var] = i
            it.block(op.regions[0])
    else:
        _masked_loop(it, op, var, start, end)
    it.env.pop(var, None)


def _masked_loop(it: Interpreter, op: Op, var: str, start, end):
    """A loop whose bounds differ by program: every trip any running program makes, with the
    programs outside their range masked."""
    outer = it.active
    start = torch.as_tensor(start, device=it.device).expand(it.P)
    end = torch.as_tensor(end, device=it.device).expand(it.P)
    running = torch.ones(it.P, dtype=torch.bool, device=it.device) if outer is None else outer
    if not running.any():
        return
    lo, hi = int(start[running].min()), int(end[running].max())
    for i in range(lo, hi):
        inside = running & (start <= i) & (i < end)
        if not inside.any():
            continue
        it.env[var] = i
        it.active = inside
        it.block(op.regions[0])
    it.active = outer


@handles("scalar")
def _scalar(it: Interpreter, op: Op):
    name = str(op.attrs["var"])
    value = _column(it.get(op.args[0]))
    old = it.env.get(name)
    if it.active is not None and old is not None:  # a masked program keeps what it read last
        value = torch.where(it.active, torch.as_tensor(value, device=it.device),
                            torch.as_tensor(old, device=it.device))
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = int(value)
    it.env[name] = value


from . import compute, memory  # noqa: E402,F401 - their handlers register on HANDLERS
