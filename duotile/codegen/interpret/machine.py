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

**Programs together.** A batch of programs runs as one: every tile value carries a leading
program axis (of size P, or 1 where the value is the same in every program), a scalar (a program
id, a value read by ``dsl.scalar``) is a Python int where it is the same in every program and a
tensor of P ints where it is not. Memory ops at per-program corners become index gathers and
index writes. A loop whose bounds differ by program runs from the least start to the greatest
end with a mask of the programs inside their range; a masked program's stores, assigns and gemms
do nothing. What a program computes never depends on P or on the others in its batch: the ops
whose fp32 results depend on the layout torch gives them (sums of floats, gemms, and the
transcendental functions, whose vector and scalar paths differ in the last bit) run program by
program on a contiguous tile of the program's own shape; the rest are exact elementwise.
"""

from __future__ import annotations

import math
from functools import lru_cache

import sympy
import torch

from ...dsl.expr import Node
from ...dsl.ir import Block, Module, Op, Value
from ..handlers import OpHandlers

HANDLERS = OpHandlers()
handles = HANDLERS.on

ELEMENTS_AT_ONCE = 1 << 20  # the programs of a batch hold at most this many elements in their largest tile
WINDOWS_AT_ONCE = 64  # up to this many distinct corners, a memory op copies windows; more, it indexes
SMALL_TILE = 1024  # ... but a tile smaller than this copies windows only up to SMALL_WINDOWS corners
SMALL_WINDOWS = 16


@lru_cache(maxsize=4096)
def _compiled(expr: sympy.Basic) -> tuple:
    """(a Python function of the expression's free symbols, their names in its argument order), or
    (None, its value) for a constant:
    found once per expression (naming and sorting the symbols at every evaluation was a tenth of
    the interpreter's time on the tiny models' generations)."""
    if not expr.free_symbols:
        return None, (int(expr) if expr.is_Integer else float(expr))
    names = tuple(sorted(str(s) for s in expr.free_symbols))
    syms = [sympy.Symbol(n, integer=True, nonnegative=True) for n in names]
    fn = sympy.lambdify(syms, expr, modules=[{"ceiling": math.ceil, "floor": math.floor}, "math"])
    return fn, names


@lru_cache(maxsize=4096)
def _integer_form(expr: sympy.Basic):
    """A function of the scalars (ints, or int64 tensors of the batch's values) computing an
    integer expression exactly with integer ops (sums, products, floor and ceiling of a quotient,
    ``Mod``, ``Min``, ``Max``), or None for any other form (evaluated program by program)."""
    try:
        return _form(expr)
    except _NotInteger:
        return None


class _NotInteger(Exception):
    pass


def _form(e: sympy.Basic):
    if e.is_Integer:
        v = int(e)
        return lambda env: v
    if e.is_Symbol:
        name = str(e)
        return lambda env: env[name]
    kids = [_form(a) for a in e.args] if isinstance(e, (sympy.Add, sympy.Mul, sympy.Mod, sympy.Min, sympy.Max)) \
        else None
    if isinstance(e, sympy.Add):
        return lambda env: sum((k(env) for k in kids[1:]), kids[0](env))
    if isinstance(e, sympy.Mul):
        return lambda env: math.prod((k(env) for k in kids[1:]), start=kids[0](env))
    if isinstance(e, sympy.Mod):
        return lambda env: kids[0](env) % kids[1](env)
    if isinstance(e, (sympy.Min, sympy.Max)):
        pick = torch.minimum if isinstance(e, sympy.Min) else torch.maximum
        return lambda env: _fold(pick, [k(env) for k in kids])
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) >= 0:
        base, n = _form(e.base), int(e.exp)
        return lambda env: base(env) ** n
    if isinstance(e, (sympy.floor, sympy.ceiling)):
        num, den = (_form(x) for x in sympy.fraction(sympy.together(e.args[0])))
        if isinstance(e, sympy.floor):
            return lambda env: num(env) // den(env)
        return lambda env: -((-num(env)) // den(env))
    raise _NotInteger(e)


def _fold(pick, vals):
    out = vals[0]
    for v in vals[1:]:
        if isinstance(out, torch.Tensor) or isinstance(v, torch.Tensor):
            out = pick(torch.as_tensor(out), torch.as_tensor(v))
        else:
            out = min(out, v) if pick is torch.minimum else max(out, v)
    return out


def _lift(t, rank: int):
    """``t`` with the leading program axis and ``rank`` tile axes (size-1 axes inserted after the
    program axis, as broadcasting would put them before the tile's own); numbers and 0-d tensors
    as they are."""
    if not isinstance(t, torch.Tensor) or t.dim() in (0, rank + 1):
        return t
    return t.view(t.shape[0], *([1] * (rank + 1 - t.dim())), *t.shape[1:])


def _programs(t: torch.Tensor) -> int:
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
        fn, names = _compiled(e)
        if fn is None:
            return names
        args = [self.env[n] for n in names]
        if not any(isinstance(a, torch.Tensor) for a in args):
            return fn(*args)
        whole = _integer_form(e)
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
    col = t.reshape(_programs(t), -1)[:, 0].long()
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


# -- memory ------------------------------------------------------------------------------------
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
    return out.reshape(_programs(out), *full)


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
    picked = idx.reshape(_programs(idx), -1).long()
    it.put(op.result, _read(it, op, tensor, offsets, op.attrs["axis"], picked))


def _write(it: Interpreter, tensor: torch.Tensor, value: torch.Tensor, offsets: list, shape: list[int],
           axis=None, picked=None):
    """``value`` (P or 1, *shape) into ``tensor`` at each running program's corner; elements
    outside the tensor are dropped."""
    rank = len(shape)
    value = torch.broadcast_to(_lift(value, rank), [_programs(value), *shape]).to(tensor.dtype)
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
    value = value.reshape(_programs(value), *shape)
    _write(it, tensor, value, [it.scalar(o) for o in op.attrs["offsets"]], shape)


@handles("scatter")
def _scatter(it: Interpreter, op: Op):
    """Row r of the tile goes to the index ``idx[r]`` names along the scattered axis; the other
    axes clip like a store's; a row whose index is < 0 or >= the size is dropped."""
    tensor = it.tensors[op.attrs["tensor"]]
    shape = [int(d) for d in op.attrs["shape"]]
    idx = it.get(op.args[1])
    picked = idx.reshape(_programs(idx), -1).long()
    _write(it, tensor, it.get(op.args[0]), [it.scalar(o) for o in op.attrs["offsets"]], shape,
           op.attrs["axis"], picked)


@handles("alloc")
def _alloc(it: Interpreter, op: Op):
    t = op.result.type
    fill = op.attrs["fill"]
    fill = float("nan") if fill is None and t.dtype.is_float else (fill or 0)
    it.put(op.result, torch.full([it.P, *[int(d) for d in t.shape]], fill, dtype=t.dtype.torch, device=it.device))


def _overwrite(it: Interpreter, dst: torch.Tensor, src) -> None:
    """``dst`` (a buffer) takes ``src`` in the running programs."""
    src = torch.broadcast_to(_lift(src, dst.dim() - 1), dst.shape) if isinstance(src, torch.Tensor) else src
    running = it.mask(dst.dim() - 1)
    if running is None:
        dst.copy_(src)
    else:
        dst.copy_(torch.where(running, torch.as_tensor(src, dtype=dst.dtype, device=dst.device), dst))


@handles("assign")
def _assign(it: Interpreter, op: Op):
    _overwrite(it, it.get(op.args[0]), it.get(op.args[1]))


# -- compute ------------------------------------------------------------------------------------
def _each(t: torch.Tensor, p: int) -> torch.Tensor:
    """Program p's tile, contiguous (the layout a program alone has)."""
    return (t[p] if t.shape[0] > 1 else t[0]).contiguous()


@handles("gemm")
def _gemm(it: Interpreter, op: Op):
    a, b, acc = (it.get(v) for v in op.args)
    for p in range(acc.shape[0]):  # program by program: torch's blocking of a batch may differ from one
        if it.active is not None and not bool(it.active[p]):
            continue
        x, y = _each(a, p).float(), _each(b, p).float()
        acc[p] += (x.t() if op.attrs["transpose_a"] else x) @ (y.t() if op.attrs["transpose_b"] else y)


@handles("reduce")
def _reduce(it: Interpreter, op: Op):
    x = it.get(op.args[0])
    axis, fn = op.attrs["axis"], op.attrs["fn"]
    shape = [int(d) for d in op.result.type.shape]
    if fn == "sum" and x.dtype.is_floating_point:  # the order of a float sum: program by program
        out = torch.stack([_each(x, p).sum(axis, dtype=x.dtype) for p in range(x.shape[0])])
    else:
        out = {"sum": lambda: x.sum(axis + 1, dtype=x.dtype), "max": lambda: x.amax(axis + 1),
               "min": lambda: x.amin(axis + 1)}[fn]()
    it.put(op.result, out.reshape(_programs(out), *shape))


def _floordiv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    zero = b == 0
    q = torch.floor_divide(a, torch.where(zero, torch.ones_like(b), b))  # torch raises on an integer 0
    return torch.where(zero, torch.zeros_like(q), q)


def _mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    zero = b == 0
    r = torch.remainder(a, torch.where(zero, torch.ones_like(b), b))
    return torch.where(zero, torch.broadcast_to(a, r.shape), r)


def _per_program(fn):
    """``fn`` applied to each program's tile alone: the transcendental functions' vector and
    scalar paths may differ in the last bit, so where an element falls in a batch must not matter."""
    def apply(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return fn(t)
        return torch.stack([fn(_each(t, p)) for p in range(t.shape[0])])

    return apply


_EW = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "floordiv": _floordiv, "mod": _mod,
    "max": torch.maximum, "min": torch.minimum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or, "not": torch.logical_not,
    "neg": torch.neg, "abs": torch.abs, "exp": _per_program(torch.exp), "exp2": _per_program(torch.exp2),
    "log": _per_program(torch.log), "log2": _per_program(torch.log2), "sqrt": torch.sqrt,
    "rsqrt": _per_program(torch.rsqrt), "sigmoid": _per_program(torch.sigmoid),
    "bitand": torch.bitwise_and, "bitor": torch.bitwise_or, "bitxor": torch.bitwise_xor,
    "shl": torch.bitwise_left_shift, "shr": torch.bitwise_right_shift,
}


_CONSTS: dict[tuple, torch.Tensor] = {}


def constant(x, dtype, device) -> torch.Tensor:
    """A 0-d tensor of ``x``, made once per value (by its repr: -0.0 is not 0.0), dtype and device.
    Never written: every op reading it makes a new tensor."""
    key = (repr(x), dtype, device)
    t = _CONSTS.get(key)
    if t is None:
        if len(_CONSTS) > 65536:
            _CONSTS.clear()
        t = _CONSTS[key] = torch.tensor(x, dtype=dtype, device=device)
    return t


def _as_tensor(x, dtype, device):
    return x if isinstance(x, torch.Tensor) else constant(x, dtype, device)


def _to(t: torch.Tensor, dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def apply_ew(fn: str, args: list, dtype: torch.dtype, device) -> torch.Tensor:
    if fn == "where":
        c, a, b = args
        return _to(torch.where(c, _as_tensor(a, dtype, device), _as_tensor(b, dtype, device)), dtype)
    if fn == "splat":
        return _to(torch.as_tensor(args[0], device=device), dtype)
    if fn == "bitcast":  # the same bits, another type of the width
        return args[0].contiguous().view(dtype)
    tensors = [_as_tensor(a, dtype if not isinstance(a, bool) else torch.bool, device) for a in args]
    if fn in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"):
        return _EW[fn](*tensors)
    return _to(_EW[fn](*[_to(t, dtype) for t in tensors]), dtype)


def _shaped(out, t) -> torch.Tensor:
    """An op's result at its type's shape, with the program axis (P or 1)."""
    rank = len(t.shape)
    out = _to(_lift(out, rank), t.dtype.torch)
    return torch.broadcast_to(out, [_programs(out), *[int(d) for d in t.shape]])


@handles("ew")
def _ew(it: Interpreter, op: Op):
    t = op.result.type
    rank = len(t.shape)
    args = [_lift(it.get(a, rank), rank) for a in op.args]
    out = apply_ew(op.attrs["fn"], args, t.dtype.torch, it.device)
    it.put(op.result, _shaped(out, t).clone())


@handles("cast")
def _cast(it: Interpreter, op: Op):
    it.put(op.result, _to(it.get(op.args[0]), op.attrs["dtype"].torch))


@handles("iota")
def _iota(it: Interpreter, op: Op):
    n = int(op.result.type.shape[0])
    it.put(op.result, torch.arange(n, dtype=torch.int32, device=it.device).view(1, n))


@handles("expand")
def _expand(it: Interpreter, op: Op):
    x = it.get(op.args[0])
    it.put(op.result, _lift(x, len(op.result.type.shape) - 1).unsqueeze(op.attrs["axis"] + 1))


@handles("map")
def _map(it: Interpreter, op: Op):
    inputs = [it.get(a) for a in op.args]
    out = _eval(it, op.attrs["expr"], inputs)
    into = op.attrs.get("into")
    if into is not None:
        _overwrite(it, it.get(into), out)
    else:
        it.put(op.result, _shaped(out, op.result.type).clone())


def _eval(it: Interpreter, node: Node, inputs: list) -> torch.Tensor:
    return _compiled_node(node)(it, inputs)


def _compiled_node(node: Node):
    """A closure computing ``node`` from a map's inputs (each with its program axis, lifted to the
    node's rank), made once and kept on the node: walking the tree at every evaluation (its
    kinds, dtypes and child lists) was a third of the interpreter's own time on the tiny models'
    generations."""
    fn = node.__dict__.get("_interpret")
    if fn is not None:
        return fn
    dtype, kind, attr, rank = node.dtype.torch, node.kind, node.attr, len(node.shape)
    if kind == "arg":
        def fn(it, inputs):
            return _lift(inputs[attr], rank)
    elif kind == "const":
        def fn(it, inputs):
            return constant(attr, dtype, it.device)
    elif kind == "scalar":
        def fn(it, inputs):
            s = it.scalar(attr)
            return _to(s, dtype).view(-1, *([1] * rank)) if isinstance(s, torch.Tensor) else constant(s, dtype,
                                                                                                      it.device)
    elif kind == "iota":
        n = int(node.shape[0])

        def fn(it, inputs):
            return torch.arange(n, dtype=torch.int32, device=it.device).view(1, n)
    else:
        kids = [_compiled_node(c) for c in node.children]
        if kind == "expand":
            child_rank = len(node.children[0].shape)

            def fn(it, inputs):
                x = kids[0](it, inputs)
                return x if x.dim() == 0 else _lift(x, child_rank).unsqueeze(attr + 1)
        elif kind == "cast":
            to = attr.torch

            def fn(it, inputs):
                return _to(kids[0](it, inputs), to)
        else:
            def fn(it, inputs):
                return apply_ew(kind, [_lift(k(it, inputs), rank) for k in kids], dtype, it.device)
    object.__setattr__(node, "_interpret", fn)  # a frozen dataclass: the cache is not a field
    return fn
