"""The tile ops a kernel body calls. Each checks its arguments and records one IR op."""

from __future__ import annotations

import builtins
import re

import sympy

from . import builder, dtypes
from .dtypes import DType
from .ir import Expr, Op, Role, TensorParam, TileType, Value
from .tile import TensorRef, TensorView, Tile, as_expr, is_role

UNARY = ("neg", "abs", "not", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid")
BINARY = ("add", "sub", "mul", "div", "floordiv", "mod", "max", "min", "lt", "le", "gt", "ge", "eq", "ne", "and",
          "or", "bitand", "bitor", "bitxor", "shl", "shr")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not")
FLOAT_ONLY = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid")
INTEGER_ONLY = ("floordiv", "mod")  # `//` and `%`: Python's floor semantics, integers only
REDUCE = ("sum", "max", "min")
# bit operations on integer tiles (``&``, ``|``, ``^``, ``<<``, ``>>``); shifts take a constant count
BITWISE = ("bitand", "bitor", "bitxor", "shl", "shr")
SHIFTS = ("shl", "shr")
# ``t.bitcast(dtype)``: the same bits read as another type of the same width
BITCASTS = {("f32", "i32"), ("i32", "f32")}


# -- loops ----------------------------------------------------------------------------------
def _loop_names(default: str, count: int) -> list[str]:
    """Name loop variables after the Python targets of the ``for`` line when we can read it."""
    b = builder.current()
    loc = b.loc()
    names = []
    if loc is not None:
        m = re.match(r"\s*for\s+\(?\s*([\w\s,]+?)\s*\)?\s+in\b", loc.text)
        if m:
            names = [n.strip() for n in m.group(1).split(",")]
    if len(names) != count:
        names = [f"{default}{i}" for i in builtins.range(count)]  # (this module's `range` is dsl.range)
    taken = {str(s) for s in getattr(b, "symbols", ())}
    out = []
    for name in names:
        unique, k = name, 1
        while unique in taken:
            unique, k = f"{name}_{k}", k + 1
        taken.add(unique)
        out.append(unique)
    b.symbols = getattr(b, "symbols", set()) | set(out)
    return out


def _index_var(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


def grid(*extents):
    """The logical launch grid: ``for m, n in dsl.grid(cdiv(M, BM), cdiv(N, BN))``. A kernel may
    hold several grids one after another: each is a phase, launched once the one before has
    finished (a split reduction, then its combine), and they share ``dsl.workspace`` tensors."""
    b = builder.current()
    if b.stack[-1] is not b.root:
        raise builder.error("dsl.grid must be an outermost statement of the kernel, not inside another grid")
    if not extents:
        raise builder.error("dsl.grid needs at least one extent")
    vars_ = [_index_var(n) for n in _loop_names("pid", len(extents))]
    op = Op("grid", attrs={"vars": vars_, "extents": [as_expr(e) for e in extents]})
    with b.region(op):
        yield vars_[0] if len(vars_) == 1 else tuple(vars_)


def range(extent, start=0, stop=None):  # noqa: A001 - mirrors the builtin on purpose
    """A sequential loop over ``start .. extent-1`` inside the grid body; with ``stop``, a
    one-element integer tile read from data, it ends before ``min(extent, stop)`` instead."""
    yield from _loop(extent, start, None, stop)


def pipelined(extent, stages=2, start=0, stop=None):
    """A loop whose loads the target may overlap with compute, ``stages`` deep (``stop`` as in
    ``range``)."""
    if not isinstance(stages, int) or stages < 1:
        raise builder.error(f"pipelined stages must be a positive int, got {stages!r}")
    yield from _loop(extent, start, stages, stop)


def _loop(extent, start, stages, stop):
    b = builder.current()
    if b.stack[-1] is b.root:
        raise builder.error("loops must sit inside dsl.grid")
    args = () if stop is None else (_loop_stop(stop),)
    var = _index_var(_loop_names("k", 1)[0])
    attrs = {"var": var, "extent": as_expr(extent), "start": as_expr(start), "stages": stages}
    with b.region(Op("for", args=args, attrs=attrs)):
        yield var


def _loop_stop(stop) -> Value:
    """A loop's data-read end: a one-element integer tile (``dsl.load(counts[e], (1,))``, or math
    of such tiles). The loop's ``extent`` stays its static bound: passes and capacity checks that
    count trips read it, the target ends the loop at the smaller of the two."""
    if not isinstance(stop, Tile):
        raise builder.error(f"a loop's stop is a one-element integer tile read from data, got {stop!r} (a size, "
                            "tunable or loop variable belongs in the extent)")
    if stop.dtype.is_float or stop.dtype == dtypes.bool_ or any(d != 1 for d in stop.value.type.shape):
        hint = " (a condition gates a loop as dsl.where(cond, steps, 0).to(dsl.i32))" \
            if stop.dtype == dtypes.bool_ else ""
        raise builder.error(f"a loop's stop is a one-element integer tile, got {stop.value.type}{hint}")
    return stop.value


def scalar(tile: Tile) -> sympy.Symbol:
    """A one-element integer tile read from data as an index value, for the offsets of loads and
    stores: ``e = dsl.scalar(dsl.load(tile_expert[t], (1,)))`` then ``w[e, n * BN, 0]``. It is an
    integer symbol defined from here to the end of the enclosing block (a loop variable's kind),
    which targets hold in a scalar every thread reads. Loop and grid bounds stay sizes, tunables and
    loop variables (a loop's end read from data is ``stop=``). Nothing checks its range: a load at
    an offset outside the tensor reads zeros (or ``other``), a store there is dropped, as always."""
    b = builder.current()
    if b.stack[-1] is b.root:
        raise builder.error("dsl.scalar must sit inside dsl.grid")
    if not isinstance(tile, Tile):
        raise builder.error(f"dsl.scalar takes a one-element integer tile, got {tile!r}")
    if tile.dtype.is_float or tile.dtype == dtypes.bool_ or any(d != 1 for d in tile.value.type.shape):
        raise builder.error(f"dsl.scalar takes a one-element integer tile, got {tile.value.type}")
    loc = b.loc()
    m = re.match(r"\s*(\w+)\s*=", loc.text) if loc is not None else None
    var = sympy.Symbol(_scalar_name(m.group(1) if m else "s"), integer=True)  # of any sign: data
    b.emit(Op("scalar", args=(tile.value,), attrs={"var": var}))
    return var


def _scalar_name(name: str) -> str:
    """A data scalar's symbol: the Python name it is bound to, made unique among the kernel's
    symbols (``e``, ``e_1``, ...)."""
    b = builder.current()
    taken = {str(s) for s in getattr(b, "symbols", ())}
    unique, k = name, 1
    while unique in taken:
        unique, k = f"{name}_{k}", k + 1
    b.symbols = taken | {unique}
    return unique


def workspace(name: str, shape, dtype: DType = dtypes.f32):
    """Scratch in global memory for one call, ``shape`` in sizes and tunables, e.g. the partial
    sums of a split reduction: ``dsl.workspace("partial", (SPLIT, a.M, b.N), dsl.f32)``. The
    compiled kernel allocates it (uninitialised) and passes it to every phase; a phase reads only
    what an earlier one wrote. Declared at the kernel's top level, before the grid that writes it."""
    b = builder.current()
    if b.stack[-1] is not b.root:
        raise builder.error("dsl.workspace must be declared at the kernel's top level, outside any grid")
    if not (isinstance(name, str) and name.isidentifier()):
        raise builder.error(f"a workspace name must be an identifier, got {name!r}")
    if name in b.tensor_names:
        raise builder.error(f"workspace {name!r} clashes with another tensor of the kernel")
    if not isinstance(dtype, DType):
        raise builder.error(f"workspace {name!r}: dtype must be a dsl dtype, got {dtype!r}")
    dims = tuple(as_expr(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    for d in dims:
        if d.is_number and int(d) < 1:
            raise builder.error(f"workspace {name!r}: dimensions must be positive, got {tuple(shape)!r}")
    names = tuple(int(d) if d.is_number else str(d) for d in dims)
    param = TensorParam(name, dims, dtype, dims=names, workspace=True)
    b.tensor_names.add(name)
    b.workspaces.append(param)
    return TensorRef(param, ())


def require(condition, message: str) -> None:
    """A condition on the kernel's sizes (``kv.R >= q.D + q.D // 32``) that a call must meet, or
    fail with ``message`` at this line: checked now where it is already decided, else once the
    call's sizes are bound (``passes/bind_shapes.py``); a condition on a dynamic size is not
    checked. For what a read past a tensor's end would otherwise take silently as zeros."""
    if condition in (True, False, sympy.true, sympy.false):
        if not bool(condition):
            raise builder.error(message)
        return
    if not isinstance(condition, sympy.core.relational.Relational):
        raise builder.error(f"dsl.require takes a comparison of sizes, got {condition!r}")
    b = builder.current()
    b.requires.append((condition, message, b.loc()))


def cdiv(a, b) -> Expr:
    return sympy.ceiling(as_expr(a) / as_expr(b))


class next_pow2(sympy.Function):  # noqa: N801 - reads like the other size helpers
    """The smallest power of two >= n: a tile that covers a dimension of any size."""

    is_integer = True
    is_positive = True

    @classmethod
    def eval(cls, n):
        if n.is_Integer:
            return sympy.Integer(1 << max(0, int(n) - 1).bit_length())
        return None


# -- buffers --------------------------------------------------------------------------------
def _shape(shape) -> tuple[Expr, ...]:
    if not isinstance(shape, (tuple, list)) or not shape:
        raise builder.error(f"a tile shape is a non-empty tuple, got {shape!r}")
    out = tuple(as_expr(d) for d in shape)
    for d in out:
        if d.is_number and int(d) < 1:
            raise builder.error(f"tile dimensions must be positive, got {shape!r}")
    return out


def full(shape, value, dtype: DType = dtypes.f32, role="vector") -> Tile:
    """A mutable buffer filled with ``value`` (write it with ``buf[:] = ...`` or dsl.gemm)."""
    t = TileType(_shape(shape), dtype, is_role(role))
    v = Value(t, mutable=True, hint="buf")
    return Tile(builder.current().emit(Op("alloc", attrs={"fill": float(value)}, result=v)))


def zeros(shape, dtype: DType = dtypes.f32, role="vector") -> Tile:
    return full(shape, 0.0, dtype, role)


def empty(shape, dtype: DType = dtypes.f32, role="vector") -> Tile:
    t = TileType(_shape(shape), dtype, is_role(role))
    v = Value(t, mutable=True, hint="buf")
    return Tile(builder.current().emit(Op("alloc", attrs={"fill": None}, result=v)))


def assign(dst: Tile, value) -> None:
    if not isinstance(dst, Tile) or not dst.value.mutable:
        raise builder.error("only buffers made by dsl.zeros / dsl.full / dsl.empty can be written")
    src = value if isinstance(value, Tile) else full_like_scalar(dst, value)
    if _broadcast(dst.shape, src.shape) != tuple(dst.shape):
        raise builder.error(f"cannot write a tile of shape {_fmt(src.shape)} into a buffer of "
                            f"shape {_fmt(dst.shape)}")
    if src.dtype != dst.dtype:
        raise builder.error(f"cannot write {src.dtype} into a {dst.dtype} buffer: cast with "
                            f".to(dsl.{dst.dtype.name})")
    builder.current().emit(Op("assign", args=(dst.value, src.value)))


def full_like_scalar(dst: Tile, value) -> Tile:
    t = TileType(dst.shape, dst.dtype, Role.VECTOR)
    op = Op("ew", args=(float(value),), attrs={"fn": "splat"}, result=Value(t))
    return Tile(builder.current().emit(op))


def arange(n) -> Tile:
    """``[0, 1, ..., n-1]`` as an int32 tile (add an axis with ``[:, None]``)."""
    t = TileType((as_expr(n),), dtypes.i32, Role.VECTOR)
    return Tile(builder.current().emit(Op("iota", attrs={"axis": 0}, result=Value(t, hint="iota"))))


def expand(x: Tile, axis: int) -> Tile:
    shape = list(x.shape)
    shape.insert(axis, sympy.Integer(1))
    t = TileType(tuple(shape), x.dtype, Role.VECTOR)
    return Tile(builder.current().emit(Op("expand", args=(x.value,), attrs={"axis": axis},
                                           result=Value(t))))


# -- memory ---------------------------------------------------------------------------------
def load(view: TensorView, shape, role="vector", other: float = 0.0) -> Tile:
    """Read a tile whose corner is ``view``; out-of-bounds elements read ``other``.

    One index may be an int tile (``table[idx, 0]``): a gather of the rows it names,
    where a negative or out-of-range index reads ``other`` for the whole row.
    """
    if not isinstance(view, TensorView):
        raise builder.error("dsl.load takes a tensor view like x[i, 0], not " + type(view).__name__)
    tensor, shape = view.tensor, _shape(shape)
    if len(shape) > tensor.ndim:
        raise builder.error(f"a {len(shape)}-d tile cannot be read from {tensor.ndim}-d tensor "
                            f"{tensor.name!r}")
    gathers = [i for i, x in enumerate(view.index) if isinstance(x, Tile)]
    t = TileType(shape, tensor.dtype, is_role(role))
    attrs = {"tensor": tensor.name, "shape": shape, "other": float(other)}
    if not gathers:
        attrs["offsets"] = tuple(as_expr(i) for i in view.index)
        return Tile(builder.current().emit(Op("load", attrs=attrs, result=Value(t, hint=tensor.name))))
    return _gather(view, gathers, t, attrs)


def _gather(view: TensorView, gathers: list[int], t: TileType, attrs: dict) -> Tile:
    tensor, shape = view.tensor, t.shape
    if len(gathers) > 1:
        raise builder.error("only one index of a load may be a tile (a gather)")
    axis = gathers[0]
    idx: Tile = view.index[axis]
    tile_axis = axis - (tensor.ndim - len(shape))
    if tile_axis < 0:
        raise builder.error("the gathered dimension must be one of the tile's dimensions")
    if idx.dtype not in (dtypes.i32, dtypes.i64):
        raise builder.error(f"gather indices must be int32 or int64, got {idx.dtype}")
    n = [d for d in idx.shape if d != 1]
    if len(n) > 1 or (n and n[0] != shape[tile_axis]) or (not n and shape[tile_axis] != 1):
        raise builder.error(f"gather index tile of shape {_fmt(idx.shape)} does not match the "
                            f"tile's dimension {tile_axis} of size {shape[tile_axis]}")
    offsets = tuple(sympy.Integer(0) if i == axis else as_expr(x) for i, x in enumerate(view.index))
    attrs.update(offsets=offsets, axis=axis)
    op = Op("gather", args=(idx.value,), attrs=attrs, result=Value(t, hint=tensor.name))
    return Tile(builder.current().emit(op))


def store(view: TensorView, value: Tile) -> None:
    """Write ``value`` with its corner at ``view``; out-of-bounds elements are dropped.

    One index may be an int tile (``y[idx, 0]``): a scatter of the tile's rows to the rows it
    names, where a negative or out-of-range index drops the whole row.
    """
    if not isinstance(view, TensorView):
        raise builder.error("dsl.store takes a tensor view like y[i, 0]")
    if not isinstance(value, Tile):
        raise builder.error("dsl.store writes a tile")
    tensor = view.tensor
    if value.dtype != tensor.dtype:
        raise builder.error(f"cannot store a {value.dtype} tile into {tensor.dtype} tensor "
                            f"{tensor.name!r}: cast it with .to(dsl.{tensor.dtype.name})")
    shape = value.shape
    if len(shape) > tensor.ndim:
        raise builder.error(f"a tile of shape {_fmt(value.shape)} does not fit {tensor.ndim}-d "
                            f"tensor {tensor.name!r}")
    scatters = [i for i, x in enumerate(view.index) if isinstance(x, Tile)]
    if scatters:
        return _scatter(view, scatters, value)
    attrs = {"tensor": tensor.name, "offsets": tuple(as_expr(i) for i in view.index), "shape": shape}
    builder.current().emit(Op("store", args=(value.value,), attrs=attrs))


def _scatter(view: TensorView, scatters: list[int], value: Tile) -> None:
    """``dsl.store(y[idx, j], tile)``: row ``r`` of the tile goes to the row ``idx[r]`` names along
    that axis (the other axes as a store at a corner); a row whose index is < 0 or >= the size is
    dropped. Rows naming one position twice leave one of them there, which one unspecified."""
    tensor, shape = view.tensor, value.shape
    if len(scatters) > 1:
        raise builder.error("only one index of a store may be a tile (a scatter)")
    axis = scatters[0]
    idx: Tile = view.index[axis]
    tile_axis = axis - (tensor.ndim - len(shape))
    if tile_axis < 0:
        raise builder.error("the scattered dimension must be one of the tile's dimensions")
    if idx.dtype not in (dtypes.i32, dtypes.i64):
        raise builder.error(f"scatter indices must be int32 or int64, got {idx.dtype}")
    n = [d for d in idx.shape if d != 1]
    if len(n) > 1 or (n and n[0] != shape[tile_axis]) or (not n and shape[tile_axis] != 1):
        raise builder.error(f"scatter index tile of shape {_fmt(idx.shape)} does not match the "
                            f"tile's dimension {tile_axis} of size {shape[tile_axis]}")
    offsets = tuple(sympy.Integer(0) if i == axis else as_expr(x) for i, x in enumerate(view.index))
    attrs = {"tensor": tensor.name, "offsets": offsets, "shape": shape, "axis": axis}
    builder.current().emit(Op("scatter", args=(value.value, idx.value), attrs=attrs))


# -- compute --------------------------------------------------------------------------------
def gemm(a: Tile, b: Tile, acc: Tile, transpose_a: bool = False, transpose_b: bool = False) -> None:
    """``acc += op(a) @ op(b)`` with fp32 accumulation; ``acc`` is a buffer."""
    for name, x in (("a", a), ("b", b), ("acc", acc)):
        if not isinstance(x, Tile) or len(x.shape) != 2:
            raise builder.error(f"gemm operand {name} must be a 2-d tile")
    if not acc.value.mutable:
        raise builder.error("gemm accumulates into a buffer: make acc with dsl.zeros(..., "
                            "role='accumulator')")
    m, ka = (a.shape[1], a.shape[0]) if transpose_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if transpose_b else b.shape
    if not _may_equal(_constant(ka), _constant(kb)):  # sizes of two tensors: verify_ir, once bound
        raise builder.error(f"gemm inner dimensions differ: a gives K={ka}, b gives K={kb}")
    if not (_may_equal(_constant(m), acc.shape[0]) and _may_equal(_constant(n), acc.shape[1])):
        raise builder.error(f"gemm accumulator has shape {_fmt(acc.shape)}, expected ({m}, {n})")
    if acc.dtype != dtypes.f32:
        raise builder.error(f"gemm accumulates in f32; the accumulator is {acc.dtype}")
    if a.dtype != b.dtype or not a.dtype.is_float:
        raise builder.error(f"gemm operands must share a float dtype, got {a.dtype} and {b.dtype}")
    attrs = {"transpose_a": transpose_a, "transpose_b": transpose_b}
    builder.current().emit(Op("gemm", args=(a.value, b.value, acc.value), attrs=attrs))


def _fmt(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _broadcast(*shapes) -> tuple[Expr, ...]:
    shapes = [s for s in shapes if s is not None]
    rank = {len(s) for s in shapes}
    if len(rank) > 1:
        raise builder.error("elementwise operands differ in rank: " + ", ".join(_fmt(s) for s in shapes)
                            + " (add an axis with t[:, None])")
    out = []
    for dims in zip(*shapes):
        real = {d for d in dims if d != 1}
        if len(real) > 1:
            raise builder.error("elementwise shapes do not broadcast: " + ", ".join(_fmt(s) for s in shapes))
        out.append(real.pop() if real else sympy.Integer(1))
    return tuple(out)


def _operand(x):
    if isinstance(x, Tile):
        return x.value
    if isinstance(x, (bool, int, float)):
        return float(x) if isinstance(x, float) or isinstance(x, bool) else sympy.Integer(x)
    if isinstance(x, sympy.Basic):
        return x
    raise builder.error(f"{x!r} ({type(x).__name__}) cannot be used in tile arithmetic")


def elementwise(fn: str, *args) -> Tile:
    if fn not in UNARY + BINARY + ("where",):
        raise builder.error(f"unknown elementwise op {fn!r}")
    ops = [_operand(a) for a in args]
    tiles = [v for v in ops if isinstance(v, Value)]
    if not tiles:
        raise builder.error(f"{fn} needs at least one tile operand")
    shape = _broadcast(*(v.type.shape for v in tiles))
    data = ops[1:] if fn == "where" else ops
    dtype = _result_dtype(fn, [v.type.dtype for v in data if isinstance(v, Value)], data)
    if fn == "div" and any(isinstance(v, Value) and not v.type.dtype.is_float for v in ops):
        # `/` is true division, as in Python: integer (and boolean) tiles are converted to the float
        # type of the other operand, or to f32 (``3 / 2 == 1.5``, ``1 / 0 == inf``, ``0 / 0`` is NaN)
        to = dtype if dtype.is_float else dtypes.f32
        return elementwise("div", *(cast(a, to) if isinstance(a, Tile) and not a.dtype.is_float else a
                                    for a in args))
    if fn in INTEGER_ONLY:
        _check_integer_division(fn, ops, dtype)
    if fn in BITWISE:
        _check_bitwise(fn, ops, dtype)
    if fn == "where" and (not isinstance(ops[0], Value) or ops[0].type.dtype != dtypes.bool_):
        raise builder.error("dsl.where's condition must be a boolean tile (a comparison)")
    if fn in FLOAT_ONLY and not dtype.is_float:
        raise builder.error(f"{fn} needs a float tile, got {dtype}")
    t = TileType(shape, dtype, Role.VECTOR)
    return Tile(builder.current().emit(Op("ew", args=tuple(ops), attrs={"fn": fn}, result=Value(t))))


_SYMBOL = {"floordiv": "//", "mod": "%"}


def _check_integer_division(fn: str, ops: list, dtype: DType) -> None:
    """``//`` and ``%`` floor like Python's on ints (``-7 // 2 == -4``, ``-7 % 2 == 1``); a zero
    divisor in a tile gives 0 for ``//`` and the dividend for ``%``; a constant zero is refused."""
    sym = _SYMBOL[fn]
    if not dtype.is_float and any(isinstance(v, Value) and v.type.dtype == dtypes.bool_ for v in ops):
        raise builder.error(f"`{sym}` takes integer tiles, not booleans: cast with .to(dsl.i32)")
    if dtype.is_float:
        raise builder.error(f"`{sym}` takes integer tiles and integer scalars, got {dtype}: for floats write "
                            f"`/` (true division){' and dsl.where' if fn == 'mod' else ''}, or cast with "
                            ".to(dsl.i32) first")
    divisor = ops[1]
    if isinstance(divisor, sympy.Basic) and divisor.is_number and divisor == 0:
        raise builder.error(f"integer `{sym}` by the constant 0")


_BIT_SYMBOL = {"bitand": "&", "bitor": "|", "bitxor": "^", "shl": "<<", "shr": ">>"}


def _check_bitwise(fn: str, ops: list, dtype: DType) -> None:
    """``& | ^ << >>`` on integer tiles: two's complement bits of the operands' integer type. ``>>``
    is arithmetic on signed types (Python's: ``-8 >> 1 == -4``) and logical on ``u8``; ``<<``
    drops the bits shifted out. A shift count is a constant in ``[0, bits)``."""
    sym = _BIT_SYMBOL[fn]
    if dtype.is_float or any(isinstance(v, float) for v in ops):
        raise builder.error(f"`{sym}` takes integer tiles and integer constants, got {dtype}: reinterpret a "
                            "float's bits with .bitcast(dsl.i32) first")
    if dtype == dtypes.bool_ or any(isinstance(v, Value) and v.type.dtype == dtypes.bool_ for v in ops):
        raise builder.error(f"`{sym}` takes integer tiles, not booleans: cast with .to(dsl.i32)"
                            + (", or combine conditions with & and |" if fn == "bitxor" else ""))
    lo, hi = int_range(dtype)
    for v in ops:
        if isinstance(v, sympy.Basic) and v.is_Integer and not lo <= int(v) <= hi:
            raise builder.error(f"the constant {int(v)} of `{sym}` does not fit {dtype} ([{lo}, {hi}]): write "
                                "it as the signed value of the same bits")
    if fn in SHIFTS:
        value, count = ops
        if not isinstance(value, Value):
            raise builder.error(f"`{sym}` shifts a tile by a constant; the value shifted must be the tile")
        if not (isinstance(count, sympy.Basic) and count.is_Integer):
            raise builder.error(f"the count of `{sym}` must be a constant integer, not a tile or an index")
        if not 0 <= int(count) < dtype.bits:
            raise builder.error(f"the count of `{sym}` on {dtype} must lie in [0, {dtype.bits}), got {int(count)}")


def int_range(dtype: DType) -> tuple[int, int]:
    """The values an integer dtype holds (``u8`` is unsigned, the others two's complement)."""
    if dtype == dtypes.u8:
        return 0, 255
    return -(1 << (dtype.bits - 1)), (1 << (dtype.bits - 1)) - 1


def bitcast(x: Tile, dtype: DType) -> Tile:
    """The bits of ``x`` read as ``dtype``, a type of the same width (``f32 <-> i32``): no value
    conversion, e.g. ``x.bitcast(dsl.i32) >> 23 & 0xFF`` is an f32's biased exponent."""
    if not isinstance(x, Tile):
        raise builder.error("dsl.bitcast reinterprets a tile")
    if not isinstance(dtype, DType):
        raise builder.error(f"bitcast target must be a dsl dtype, got {dtype!r}")
    if (x.dtype.name, dtype.name) not in BITCASTS:
        pairs = ", ".join(f"{a} -> {b}" for a, b in sorted(BITCASTS))
        raise builder.error(f"cannot bitcast {x.dtype} to {dtype}: supported are {pairs}")
    t = TileType(x.shape, dtype, Role.VECTOR)
    op = Op("ew", args=(x.value,), attrs={"fn": "bitcast"}, result=Value(t))
    return Tile(builder.current().emit(op))


MXFP4_BLOCK = 32  # values a UE8M0 scale covers in MXFP4 (model.md 1.4, 4.1)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # an e2m1 code's magnitude by its low 3 bits (model.md 4.1)


def mxfp4_values(packed: Tile, codes: Tile, first=None) -> Tile:
    """The values of MXFP4 weights (model.md 4.1) as a bf16 tile in natural order: ``packed``, a
    (R, C) u8 tile of e2m1 codes two a byte, element 2j in the low nibble of byte j and 2j + 1 in
    the high one; ``codes``, a (R, 2C / 32) u8 tile of UE8M0 scale codes, one a 32 values. Value
    (r, c) is e2m1(r, c) x 2^(codes[r, first + c // 32] - 127): exact where it is a bf16 number,
    +-Inf beyond, NaN for code 255. Both tiles are loaded ones (the GPU targets read them from
    shared memory). ``first`` (an index, e.g. of a loop variable) lets ``codes`` be wider: a tile of
    every code of the rows, loaded once before a K loop, of which each step reads its 2C / 32
    columns from ``first`` on (a loaded 4-byte-wide tile a step is a global-memory latency a step
    on targets whose bulk copies need 16 bytes a row)."""
    return _packed_fp4("mxfp4", packed, ("codes", codes, dtypes.u8), MXFP4_BLOCK, first)


def mxfp8_values(values: Tile, codes: Tile, first=None, block: int | None = None) -> Tile:
    """Block-scaled FP8 values (model.md 2.10's activations) as a bf16 tile: ``values``, a (R, C)
    e4m3 tile; ``codes``, a (R, G) u8 tile of UE8M0 scale codes, each scaling C / G consecutive
    columns (G divides C; 1 x 32 and 1 x 128 blocks, or one code for a tile inside a larger block).
    Value (r, c) is bf16(f32(values[r, c]) x 2^(codes[r, c // (C / G)] - 127)), NaN for code 255:
    exact for codes 10..246, where every e4m3 value times the scale is a normal bf16 number. Both
    tiles are loaded ones. On a target with a block-scaled MMA a gemm of such operands (this and
    ``mxfp4_values``) may keep the FP8 values and apply the codes in the MMA instead: the products
    are then exact at every code. With ``first`` (an index) and ``block`` (the columns of ``values``
    a code covers) ``codes`` may be wider: value (r, c) takes code (r, first + c // block), as
    ``mxfp4_values`` takes its ``first``."""
    _check_2d_tiles("dsl.mxfp8_values", ("values", values, dtypes.f8e4m3), ("codes", codes, dtypes.u8))
    (rows, cols), (crows, groups) = values.shape, codes.shape
    if (first is None) != (block is None):
        raise builder.error("dsl.mxfp8_values: give first and block together (the codes' first column and the "
                            "columns a code covers), or neither")
    if block is not None and (not isinstance(block, int) or block <= 0 or _divides(block, cols) is False):
        raise builder.error(f"dsl.mxfp8_values: block = {block!r} must be a positive int dividing the {cols} columns")
    count = groups if block is None else cols // block
    if crows != rows or _divides(count, cols) is False:
        raise builder.error(f"dsl.mxfp8_values: codes {_fmt(codes.shape)} do not split values {_fmt(values.shape)} "
                            f"into blocks: (R, G) with G dividing the {cols} columns")
    _check_code_columns("dsl.mxfp8_values", codes, rows, count, first, f"{cols} / {count} columns a code")
    t = TileType((rows, cols), dtypes.bf16, Role.OPERAND)
    op = Op("mxfp8", args=(values.value, codes.value), attrs=_code_attrs(first, count), result=Value(t, hint="fp8"))
    return Tile(builder.current().emit(op))


NVFP4_BLOCK = 16  # values an E4M3 scale covers in V4.1's NVFP4-like compressed rows (model.md 3.4)


def nvfp4_values(packed: Tile, scales: Tile) -> Tile:
    """The values of V4.1's NVFP4-like rows (model.md 3.4, 4.3) as a bf16 tile in natural order:
    ``packed``, a (R, C) u8 tile of e2m1 codes two a byte (element 2j in the low nibble of byte j,
    as ``mxfp4_values``); ``scales``, a (R, 2C / 16) e4m3 tile, one scale a 16 values, no global
    scale. Value (r, c) is e2m1(r, c) x scales[r, c // 16]: exact in bf16 for every pair (two
    significant bits times four), NaN where the scale is. Both tiles are loaded ones."""
    return _packed_fp4("nvfp4", packed, ("scales", scales, dtypes.f8e4m3), NVFP4_BLOCK, None)


def cumsum(x: Tile, exclusive: bool = False) -> Tile:
    """Prefix sums of an i32 tile along its last axis (``exclusive``: each element the sum of those
    before it, the first 0): exact, in index order. Counts and positions: where each selected
    element of a row goes in a compacted list (``topk.py``)."""
    if not isinstance(x, Tile):
        raise builder.error(f"dsl.cumsum takes a tile, got {type(x).__name__}")
    if x.dtype != dtypes.i32:
        raise builder.error(f"dsl.cumsum sums i32 tiles (counts, positions), got {x.dtype}: cast with .to(dsl.i32)")
    op = Op("cumsum", args=(x.value,), attrs={"exclusive": bool(exclusive)},
            result=Value(TileType(x.shape, dtypes.i32, Role.VECTOR), hint="scan"))
    return Tile(builder.current().emit(op))


def _check_2d_tiles(what: str, *tiles) -> None:
    """Each (name, tile, dtype) is a 2-d tile of that dtype, else an error naming it."""
    for name, t, dtype in tiles:
        if not isinstance(t, Tile):
            raise builder.error(f"{what}: {name} must be a tile, got {type(t).__name__}")
        if t.dtype != dtype or len(t.shape) != 2:
            raise builder.error(f"{what}: {name} must be a 2-d {dtype} tile, got {t.dtype} {_fmt(t.shape)}")


def _packed_fp4(name: str, packed: Tile, scales: tuple, block: int, first) -> Tile:
    """The op ``name`` of packed e2m1 codes (R, C) and their per-``block`` scales ``(label, tile,
    dtype)``: bf16 values (R, 2C), the scales' columns from ``first`` on (``mxfp4_values``)."""
    what = f"dsl.{name}_values"
    _check_2d_tiles(what, ("packed", packed, dtypes.u8), scales)
    rows, cols = packed.shape
    if _divides(block, 2 * cols) is False:
        raise builder.error(f"{what}: {_fmt(packed.shape)} packed bytes hold {2 * cols} values a row, "
                            f"not whole blocks of {block}")
    count = 2 * cols // block
    _check_code_columns(what, scales[1], rows, count, first, f"one a {block} values of each row")
    t = TileType((rows, 2 * cols), dtypes.bf16, Role.OPERAND)
    op = Op(name, args=(packed.value, scales[1].value), attrs=_code_attrs(first, count), result=Value(t, hint="fp4"))
    return Tile(builder.current().emit(op))


def _code_attrs(first, count) -> dict:
    """A scaled-values op's codes: the first column read (an index) and how many a row."""
    return {"first": as_expr(0 if first is None else first), "count": as_expr(count)}


def _check_code_columns(what: str, codes: Tile, rows, count, first, per: str) -> None:
    """``codes`` holds the ``count`` columns a row the op reads: exactly, or (``first`` given) at least."""
    want = (rows, count)
    if first is None and not all(_may_equal(a, b) for a, b in zip(codes.shape, want)):
        raise builder.error(f"{what}: codes must be {_fmt(want)} ({per}), got {_fmt(codes.shape)}")
    if first is not None:
        crows, groups = codes.shape
        start, g, n = (sympy.sympify(as_expr(v)) for v in (first, groups, count))
        known = g.is_Integer and n.is_Integer
        if crows != rows or (known and g < n) or (known and start.is_Integer and not 0 <= start <= g - n):
            raise builder.error(f"{what}: codes {_fmt(codes.shape)} from column {start} do not hold {count} "
                                f"columns for each of the {rows} rows ({per})")


def _constant(size):
    """A size simplified where that can make it an integer: one without symbols (a symbol's size
    may equal anything until bound, so simplifying it, which cost the config search seconds a
    kernel with many gemms, changes no answer of ``_may_equal``)."""
    size = sympy.sympify(size)
    return size if size.is_Integer or size.free_symbols else sympy.simplify(size)


def _may_equal(a, b) -> bool:
    """Whether two sizes can be equal: unequal integers cannot; a symbol is checked once bound
    (``verify_ir``)."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    return a == b or not (a.is_Integer and b.is_Integer)


def _divides(d, n) -> bool | None:
    """Whether ``d`` divides ``n``; None while either is a symbol."""
    d, n = sympy.sympify(d), sympy.sympify(n)
    if not (d.is_Integer and n.is_Integer):
        return None
    return int(d) > 0 and int(n) % int(d) == 0


def logical_or_bitwise(fn: str, a, b) -> Tile:
    """``&`` / ``|``: logical on boolean tiles (conditions), bitwise on integer tiles."""
    tiles = [x for x in (a, b) if isinstance(x, Tile)]
    kinds = {"bool" if t.dtype == dtypes.bool_ else "float" if t.dtype.is_float else "int" for t in tiles}
    sym = "&" if fn == "and" else "|"
    if "float" in kinds:
        raise builder.error(f"`{sym}` takes boolean tiles (conditions) or integer tiles, not floats: compare "
                            "first, or reinterpret a float's bits with .bitcast(dsl.i32)")
    if kinds == {"bool", "int"}:
        raise builder.error(f"`{sym}` of a boolean and an integer tile: cast the condition with .to(dsl.i32)")
    if kinds == {"int"}:
        return elementwise("bit" + fn, a, b)
    return elementwise(fn, a, b)


def _result_dtype(fn: str, tile_dtypes: list[DType], data) -> DType:
    if fn in COMPARE:
        return dtypes.bool_
    dtype = tile_dtypes[0] if tile_dtypes else dtypes.f32
    for d in tile_dtypes[1:]:
        dtype = dtypes.promote(dtype, d)
    if not dtype.is_float and any(isinstance(x, float) for x in data):
        dtype = dtypes.f32
    return dtype


def _floordiv(a, b):
    return elementwise("floordiv", a, b)


def _rfloordiv(a, b):
    return elementwise("floordiv", b, a)


def _mod(a, b):
    return elementwise("mod", a, b)


def _rmod(a, b):
    return elementwise("mod", b, a)


# Tiles take `//` and `%` (``Tile`` records its other operators through ``elementwise`` too)
Tile.__floordiv__, Tile.__rfloordiv__, Tile.__mod__, Tile.__rmod__ = _floordiv, _rfloordiv, _mod, _rmod


def cast(x: Tile, dtype: DType) -> Tile:
    if not isinstance(dtype, DType):
        raise builder.error(f"cast target must be a dsl dtype, got {dtype!r}")
    t = TileType(x.shape, dtype, Role.VECTOR)
    return Tile(builder.current().emit(Op("cast", args=(x.value,), attrs={"dtype": dtype}, result=Value(t))))


def reduce(fn: str, x: Tile, axis: int) -> Tile:
    if fn not in REDUCE:
        raise builder.error(f"unknown reduction {fn!r}")
    rank = len(x.shape)
    if not -rank <= axis < rank:
        raise builder.error(f"reduction axis {axis} out of range for a {rank}-d tile")
    axis %= rank
    shape = tuple(d for i, d in enumerate(x.shape) if i != axis) or (sympy.Integer(1),)
    t = TileType(shape, x.dtype, Role.VECTOR)
    op = Op("reduce", args=(x.value,), attrs={"fn": fn, "axis": axis}, result=Value(t))
    return Tile(builder.current().emit(op))


# -- math helpers -------------------------------------------------------------------------------
def _unary(fn):
    def f(x):
        return elementwise(fn, x)

    f.__name__ = fn
    f.__doc__ = f"Elementwise {fn} of a tile."
    return f


exp, exp2, log, log2, sqrt, rsqrt, sigmoid = (_unary(n) for n in FLOAT_ONLY)


def where(cond: Tile, a, b) -> Tile:
    return elementwise("where", cond, a, b)


def maximum(a, b):
    """Elementwise max of tiles, or the max of two index expressions."""
    if isinstance(a, Tile) or isinstance(b, Tile):
        return elementwise("max", a, b)
    return sympy.Max(as_expr(a), as_expr(b))


def minimum(a, b):
    if isinstance(a, Tile) or isinstance(b, Tile):
        return elementwise("min", a, b)
    return sympy.Min(as_expr(a), as_expr(b))
