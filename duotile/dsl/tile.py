"""Proxies the kernel body computes with while it is traced: tiles, tensors, index scalars."""

from __future__ import annotations

import sympy

from . import builder
from .dtypes import DType
from .ir import Expr, Role, TensorParam, Value


class Tile:
    """A tile value during tracing. Arithmetic records elementwise ops in the Tile IR."""

    __array_priority__ = 100  # make numpy scalars defer to us

    def __init__(self, value: Value):
        self.value = value

    # -- type -----------------------------------------------------------------
    @property
    def shape(self) -> tuple[Expr, ...]:
        return self.value.type.shape

    @property
    def dtype(self) -> DType:
        return self.value.type.dtype

    def __repr__(self) -> str:
        return f"Tile({self.value!r}: {self.value.type})"

    def __bool__(self):
        raise builder.error("a tile has no truth value while tracing: use dsl.where(cond, a, b) "
                            "instead of `if`, and Python `if` only on constants and tunables")

    def __iter__(self):
        raise builder.error("a tile cannot be iterated: use dsl.range / dsl.pipelined over a count")

    # -- elementwise ------------------------------------------------------------
    def _ew(self, fn, *others):
        from .ops import elementwise

        return elementwise(fn, self, *others)

    def __add__(self, o): return self._ew("add", o)
    def __radd__(self, o): return elementwise_r("add", o, self)
    def __sub__(self, o): return self._ew("sub", o)
    def __rsub__(self, o): return elementwise_r("sub", o, self)
    def __mul__(self, o): return self._ew("mul", o)
    def __rmul__(self, o): return elementwise_r("mul", o, self)
    def __truediv__(self, o): return self._ew("div", o)
    def __rtruediv__(self, o): return elementwise_r("div", o, self)
    def __neg__(self): return self._ew("neg")
    def __abs__(self): return self._ew("abs")
    def __lt__(self, o): return self._ew("lt", o)
    def __le__(self, o): return self._ew("le", o)
    def __gt__(self, o): return self._ew("gt", o)
    def __ge__(self, o): return self._ew("ge", o)
    def __and__(self, o): return _logic("and", self, o)
    def __rand__(self, o): return _logic("and", o, self)
    def __or__(self, o): return _logic("or", self, o)
    def __ror__(self, o): return _logic("or", o, self)
    def __xor__(self, o): return self._ew("bitxor", o)
    def __rxor__(self, o): return elementwise_r("bitxor", o, self)
    def __lshift__(self, o): return self._ew("shl", o)
    def __rlshift__(self, o): return elementwise_r("shl", o, self)
    def __rshift__(self, o): return self._ew("shr", o)
    def __rrshift__(self, o): return elementwise_r("shr", o, self)
    def __invert__(self): return self._ew("not")

    def eq(self, o):
        return self._ew("eq", o)

    def ne(self, o):
        return self._ew("ne", o)

    def to(self, dtype: DType) -> Tile:
        from .ops import cast

        return cast(self, dtype)

    def bitcast(self, dtype: DType) -> Tile:
        """The same bits read as ``dtype`` (``f32 <-> i32``); ``.to`` converts values instead."""
        from .ops import bitcast

        return bitcast(self, dtype)

    # -- reductions ---------------------------------------------------------------
    def sum(self, axis: int) -> Tile:
        from .ops import reduce

        return reduce("sum", self, axis)

    def max(self, axis: int) -> Tile:
        from .ops import reduce

        return reduce("max", self, axis)

    def min(self, axis: int) -> Tile:
        from .ops import reduce

        return reduce("min", self, axis)

    # -- shape ------------------------------------------------------------------
    def __getitem__(self, index) -> Tile:
        """Only ``t[:, None]`` / ``t[None, :]`` style: add a broadcast axis."""
        from .ops import expand

        index = index if isinstance(index, tuple) else (index,)
        full = slice(None)
        if sum(i is None for i in index) == 1 and all(i is None or i == full for i in index):
            if len(index) == len(self.shape) + 1:
                return expand(self, index.index(None))
        raise builder.error(f"unsupported tile indexing {index!r}: only t[:, None] / t[None, :] "
                            "add an axis; use dsl.load for slices of tensors")

    def __setitem__(self, index, value) -> None:
        """``buf[:] = expr`` writes a whole buffer (a tile made by zeros/full/empty)."""
        from .ops import assign

        if index != slice(None) and index != (slice(None),) * len(self.shape):
            raise builder.error("only whole-buffer writes `buf[:] = value` are supported")
        assign(self, value)


def _logic(fn: str, a, b) -> Tile:
    from .ops import logical_or_bitwise

    return logical_or_bitwise(fn, a, b)


def elementwise_r(fn: str, scalar, tile: Tile) -> Tile:
    from .ops import elementwise

    return elementwise(fn, scalar, tile)


class TensorView:
    """``t[i, j]``: a tensor with the top-left corner of a tile (or a gather index) chosen."""

    def __init__(self, tensor: TensorRef, index: tuple):
        self.tensor = tensor
        self.index = index


class TensorRef:
    """A kernel's tensor parameter while tracing. ``a.M`` or ``a.shape[0]`` is its symbolic size."""

    def __init__(self, param: TensorParam, dim_names: tuple[str | int, ...]):
        self.param = param
        self._dims = dim_names

    @property
    def name(self) -> str:
        return self.param.name

    @property
    def shape(self) -> tuple[Expr, ...]:
        return self.param.shape

    @property
    def dtype(self) -> DType:
        return self.param.dtype

    @property
    def ndim(self) -> int:
        return len(self.param.shape)

    def __getattr__(self, item: str):
        dims = self.__dict__.get("_dims", ())
        if item in dims:
            return self.param.shape[dims.index(item)]
        raise AttributeError(f"tensor {self.param.name!r} has no dimension or attribute {item!r}")

    def __getitem__(self, index) -> TensorView:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != self.ndim:
            raise builder.error(f"tensor {self.name!r} has {self.ndim} dimensions but was indexed "
                                f"with {len(index)}: give the corner of the tile in every dimension")
        for i in index:
            if isinstance(i, slice):
                raise builder.error(f"index {self.name}[...] with tile corners, not slices; "
                                    "the tile's shape is dsl.load's second argument")
        return TensorView(self, index)


def as_expr(x) -> Expr:
    """An index or size as a sympy expression (ints, loop variables, shape symbols)."""
    if isinstance(x, sympy.Basic):
        return x
    if isinstance(x, bool):
        raise builder.error("a boolean is not an index")
    if isinstance(x, int):
        return sympy.Integer(x)
    if isinstance(x, Tile):
        raise builder.error("a tile was used where an index or size is needed")
    raise builder.error(f"{x!r} ({type(x).__name__}) is not an index or size")


def is_role(role: str | Role) -> Role:
    try:
        return Role.parse(role)
    except ValueError as err:
        raise builder.error(str(err)) from None
