"""Executes a bound Tile IR module with PyTorch on CPU or GPU, one program of the grid at a time.

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
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import sympy
import torch

from ...dsl.expr import Node
from ...dsl.ir import Block, Module, Op, Value
from ..handlers import OpHandlers

HANDLERS = OpHandlers()
handles = HANDLERS.on


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


class Interpreter:
    def __init__(self, module: Module, tensors: dict[str, torch.Tensor]):
        self.module = module
        self.tensors = tensors
        self.env: dict[str, int] = {}
        self.sizes = module.dynamic_sizes(tensors)  # the call's value of each dynamic size
        self.vals: dict[int, torch.Tensor] = {}
        self.device = next(iter(t.device for t in tensors.values() if t is not None))

    # -- scalars ------------------------------------------------------------------------------
    def scalar(self, e):
        if not isinstance(e, sympy.Basic):
            return e
        fn, names = _compiled(e)
        return names if fn is None else fn(*(self.env[n] for n in names))

    def get(self, v) -> torch.Tensor:
        return self.vals[v.id] if isinstance(v, Value) else self.scalar(v)

    def put(self, v: Value, t: torch.Tensor):
        self.vals[v.id] = t

    # -- control ------------------------------------------------------------------------------
    def run(self):
        grid = self.module.grid
        names = [str(v) for v in grid.attrs["vars"]]
        self.env = dict(self.sizes)
        extents = [int(self.scalar(e)) for e in grid.attrs["extents"]]
        for point in itertools.product(*(range(n) for n in extents)):
            self.env = {**self.sizes, **dict(zip(names, point))}
            self.vals = {}
            self.block(grid.regions[0])

    def block(self, block: Block):
        for op in block.ops:
            handler = HANDLERS.get(op.name)
            if handler is None:
                from ...dsl.errors import UnsupportedError

                raise UnsupportedError(f"the interpreter has no handler for {op.name}", op.loc)
            handler(self, op)


def run_module(module: Module, tensors: dict[str, torch.Tensor]) -> None:
    Interpreter(module, tensors).run()


@handles("for")
def _for(it: Interpreter, op: Op):
    var = str(op.attrs["var"])
    end = int(it.scalar(op.attrs["extent"]))
    if op.args:  # a stop read from data: the loop ends at the smaller of the two
        end = min(end, int(it.get(op.args[0]).reshape(-1)[0]))
    for i in range(int(it.scalar(op.attrs["start"])), end):
        it.env[var] = i
        it.block(op.regions[0])
    it.env.pop(var, None)


@handles("scalar")
def _scalar(it: Interpreter, op: Op):
    it.env[str(op.attrs["var"])] = int(it.get(op.args[0]).reshape(-1)[0])


# -- memory ------------------------------------------------------------------------------------
def _window(it: Interpreter, op: Op, tensor: torch.Tensor):
    """Slices of ``tensor`` covered by the tile (clipped), and where they sit in the tile."""
    return _window_at([int(it.scalar(o)) for o in op.attrs["offsets"]], [int(d) for d in op.attrs["shape"]], tensor)


def _window_at(offsets: list[int], shape: list[int], tensor: torch.Tensor):
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


def _read_tile(it: Interpreter, op: Op, source: torch.Tensor) -> torch.Tensor:
    """The tile at ``op``'s corner of ``source``; what lies outside it reads ``other``."""
    offsets = [int(it.scalar(o)) for o in op.attrs["offsets"]]
    return _read_tile_at(it, op, source, offsets)


def _read_tile_at(it: Interpreter, op: Op, source: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    t = op.result.type
    out = torch.full([int(d) for d in t.shape], op.attrs["other"], dtype=t.dtype.torch, device=it.device)
    src, dst = _window_at(offsets, [int(d) for d in op.attrs["shape"]], source)
    if src is not None:
        out[dst] = source[src]
    return out


@handles("load")
def _load(it: Interpreter, op: Op):
    it.put(op.result, _read_tile(it, op, it.tensors[op.attrs["tensor"]]))


def _narrowed(it: Interpreter, op: Op, tensor: torch.Tensor, axis: int):
    """``tensor`` cut to the tile's window on every axis but the gathered one, and the tile's
    offsets into that cut (None where the window is empty): a gather then copies what the tile
    reads, not whole slices of the tensor (a weight gather read every expert's rows before)."""
    offsets = [int(it.scalar(o)) for o in op.attrs["offsets"]]
    shape = [int(d) for d in op.attrs["shape"]]
    lead = tensor.dim() - len(shape)
    for d in range(tensor.dim()):
        if d == axis:
            continue
        n = 1 if d < lead else shape[d - lead]
        lo, hi = max(offsets[d], 0), min(offsets[d] + n, tensor.shape[d])
        if hi <= lo:
            return None, None
        tensor, offsets[d] = tensor.narrow(d, lo, hi - lo), offsets[d] - lo
    return tensor, offsets


@handles("gather")
def _gather(it: Interpreter, op: Op):
    """The gathered axis picks rows by index; the other axes read like a load from those rows."""
    tensor = it.tensors[op.attrs["tensor"]]
    axis = op.attrs["axis"]
    idx = it.get(op.args[0]).reshape(-1).long()
    valid = (idx >= 0) & (idx < tensor.shape[axis])
    cut, offsets = _narrowed(it, op, tensor, axis)
    if cut is None:
        t = op.result.type
        it.put(op.result, torch.full([int(d) for d in t.shape], op.attrs["other"], dtype=t.dtype.torch,
                                     device=it.device))
        return
    picked = cut.index_select(axis, torch.where(valid, idx, torch.zeros_like(idx)))
    out = _read_tile_at(it, op, picked, offsets)
    mask_shape = [1] * out.dim()
    mask_shape[axis - (tensor.dim() - len(op.attrs["shape"]))] = -1
    it.put(op.result, torch.where(valid.view(mask_shape), out, torch.full_like(out, op.attrs["other"])))


@handles("store")
def _store(it: Interpreter, op: Op):
    tensor = it.tensors[op.attrs["tensor"]]
    src, dst = _window(it, op, tensor)
    if src is None:
        return
    value = it.get(op.args[0]).reshape([int(d) for d in op.attrs["shape"]])
    tensor[src] = value[dst]


@handles("scatter")
def _scatter(it: Interpreter, op: Op):
    """Row r of the tile goes to the index ``idx[r]`` names along the scattered axis; the other
    axes clip like a store's; a row whose index is < 0 or >= the size is dropped."""
    tensor, axis = it.tensors[op.attrs["tensor"]], op.attrs["axis"]
    shape = [int(d) for d in op.attrs["shape"]]
    offsets = [int(it.scalar(o)) for o in op.attrs["offsets"]]
    lead = tensor.dim() - len(shape)
    if not all(0 <= offsets[d] < tensor.shape[d] for d in range(lead)):
        return
    dst = tensor
    for d in reversed(range(lead)):  # the leading points (the scattered axis is a tile axis)
        dst = dst.select(d, offsets[d])
    idx = it.get(op.args[1]).reshape(-1).long()
    to, frm = [], []
    for d in range(lead, tensor.dim()):
        if d == axis:
            rows = torch.nonzero((idx >= 0) & (idx < tensor.shape[d])).reshape(-1)
            to.append(idx[rows])
            frm.append(rows)
            continue
        off, n = offsets[d], shape[d - lead]
        lo, hi = max(off, 0), min(off + n, tensor.shape[d])
        if hi <= lo:
            return
        to.append(slice(lo, hi))
        frm.append(slice(lo - off, hi - off))
    value = torch.broadcast_to(it.get(op.args[0]), shape)
    dst[tuple(to)] = value[tuple(frm)].to(tensor.dtype)


@handles("alloc")
def _alloc(it: Interpreter, op: Op):
    t = op.result.type
    fill = op.attrs["fill"]
    fill = float("nan") if fill is None and t.dtype.is_float else (fill or 0)
    it.put(op.result, torch.full([int(d) for d in t.shape], fill, dtype=t.dtype.torch, device=it.device))


@handles("assign")
def _assign(it: Interpreter, op: Op):
    dst, src = it.get(op.args[0]), it.get(op.args[1])
    dst.copy_(torch.broadcast_to(src, dst.shape))


# -- compute ------------------------------------------------------------------------------------
@handles("gemm")
def _gemm(it: Interpreter, op: Op):
    a, b, acc = (it.get(v) for v in op.args)
    a = a.float().t() if op.attrs["transpose_a"] else a.float()
    b = b.float().t() if op.attrs["transpose_b"] else b.float()
    acc += a @ b


@handles("reduce")
def _reduce(it: Interpreter, op: Op):
    x = it.get(op.args[0])
    axis, fn = op.attrs["axis"], op.attrs["fn"]
    out = {"sum": lambda: x.sum(axis, dtype=x.dtype), "max": lambda: x.amax(axis),
           "min": lambda: x.amin(axis)}[fn]()
    it.put(op.result, out.reshape([int(d) for d in op.result.type.shape]))


def _floordiv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    zero = b == 0
    q = torch.floor_divide(a, torch.where(zero, torch.ones_like(b), b))  # torch raises on an integer 0
    return torch.where(zero, torch.zeros_like(q), q)


def _mod(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    zero = b == 0
    r = torch.remainder(a, torch.where(zero, torch.ones_like(b), b))
    return torch.where(zero, torch.broadcast_to(a, r.shape), r)


_EW = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "floordiv": _floordiv, "mod": _mod,
    "max": torch.maximum, "min": torch.minimum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or, "not": torch.logical_not,
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
    "log2": torch.log2, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid,
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
        return torch.tensor(args[0], dtype=dtype, device=device)
    if fn == "bitcast":  # the same bits, another type of the width
        return args[0].contiguous().view(dtype)
    tensors = [_as_tensor(a, dtype if not isinstance(a, bool) else torch.bool, device) for a in args]
    if fn in ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"):
        return _EW[fn](*tensors)
    return _to(_EW[fn](*[_to(t, dtype) for t in tensors]), dtype)


@handles("ew")
def _ew(it: Interpreter, op: Op):
    args = [it.get(a) for a in op.args]
    t = op.result.type
    out = apply_ew(op.attrs["fn"], args, t.dtype.torch, it.device)
    it.put(op.result, torch.broadcast_to(out, [int(d) for d in t.shape]).clone())


@handles("cast")
def _cast(it: Interpreter, op: Op):
    it.put(op.result, _to(it.get(op.args[0]), op.attrs["dtype"].torch))


@handles("iota")
def _iota(it: Interpreter, op: Op):
    n = int(op.result.type.shape[0])
    it.put(op.result, torch.arange(n, dtype=torch.int32, device=it.device))


@handles("expand")
def _expand(it: Interpreter, op: Op):
    it.put(op.result, it.get(op.args[0]).unsqueeze(op.attrs["axis"]))


@handles("map")
def _map(it: Interpreter, op: Op):
    inputs = [it.get(a) for a in op.args]
    out = _eval(it, op.attrs["expr"], inputs)
    into = op.attrs.get("into")
    if into is not None:
        dst = it.get(into)
        dst.copy_(torch.broadcast_to(out, dst.shape))
    else:
        t = op.result.type
        it.put(op.result, _to(torch.broadcast_to(out, [int(d) for d in t.shape]), t.dtype.torch).clone())


def _eval(it: Interpreter, node: Node, inputs: list) -> torch.Tensor:
    return _compiled_node(node)(it, inputs)


def _compiled_node(node: Node):
    """A closure computing ``node`` from a map's inputs, made once and kept on the node: walking
    the tree at every evaluation (its kinds, dtypes and child lists) was a third of the
    interpreter's own time on the tiny models' generations."""
    fn = node.__dict__.get("_interpret")
    if fn is not None:
        return fn
    dtype, kind, attr = node.dtype.torch, node.kind, node.attr
    if kind == "arg":
        def fn(it, inputs):
            return inputs[attr]
    elif kind == "const":
        def fn(it, inputs):
            return constant(attr, dtype, it.device)
    elif kind == "scalar":
        def fn(it, inputs):
            return constant(it.scalar(attr), dtype, it.device)
    elif kind == "iota":
        n = int(node.shape[0])

        def fn(it, inputs):
            return torch.arange(n, dtype=torch.int32, device=it.device)
    else:
        kids = [_compiled_node(c) for c in node.children]
        if kind == "expand":
            def fn(it, inputs):
                return kids[0](it, inputs).unsqueeze(attr)
        elif kind == "cast":
            to = attr.torch

            def fn(it, inputs):
                return _to(kids[0](it, inputs), to)
        else:
            def fn(it, inputs):
                return apply_ew(kind, [k(it, inputs) for k in kids], dtype, it.device)
    object.__setattr__(node, "_interpret", fn)  # a frozen dataclass: the cache is not a field
    return fn
