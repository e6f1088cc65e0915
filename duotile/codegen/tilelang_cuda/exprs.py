"""Print index expressions (sympy) and element expressions (dsl.expr.Node) as TileLang source."""

from __future__ import annotations

import math

import sympy

from ...dsl.dtypes import DType
from ...dsl.errors import UnsupportedError
from ...dsl.expr import Node, child_index


def index(e) -> str:
    """A sympy index expression over loop variables, as TileLang Python."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return str(e)
    if e.is_Add:
        terms = [index(t) for t in e.as_ordered_terms()]
        return "(" + " + ".join(terms).replace("+ -", "- ") + ")"
    if e.is_Mul:
        coeff, rest = e.as_coeff_Mul()
        if coeff == 1:  # a product of symbols and calls (a dynamic size times a grid variable)
            return "(" + " * ".join(index(f) for f in e.as_ordered_factors()) + ")"
        if coeff.is_Integer:
            return f"{int(coeff)} * {index(rest)}"
        if coeff.is_Rational:  # (p/q) * x only where exact: emitted as floor division
            return f"({index(coeff.p * rest)} // {coeff.q})"
    if isinstance(e, sympy.Min):
        return _nested("T.min", e.args)
    if isinstance(e, sympy.Max):
        return _nested("T.max", e.args)
    if isinstance(e, sympy.ceiling):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        return f"T.ceildiv({index(num)}, {index(den)})"
    if isinstance(e, sympy.floor):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        return f"({index(num)} // {index(den)})"
    if isinstance(e, sympy.Mod):
        return f"({index(e.args[0])} % {index(e.args[1])})"
    if _integer_power(e):  # sympy's own rewrites make them: Mod(64*x, 128) is 64*Mod(x**2, 2)
        return "(" + " * ".join([index(e.base)] * int(e.exp)) + ")"
    raise UnsupportedError(f"index expression {e} has no TileLang form")


def _integer_power(e) -> bool:
    return e.is_Pow and e.exp.is_Integer and e.exp > 0


def _nested(fn: str, args) -> str:
    out = index(args[0])
    for a in args[1:]:
        out = f"{fn}({out}, {index(a)})"
    return out


def literal(value: float, dtype: DType) -> str:
    if isinstance(value, float) and math.isinf(value):
        sign = "-" if value < 0 else ""
        return f'{sign}T.infinity("{dtype.tilelang_name}")'
    if not dtype.is_float:
        # the least i32 as arithmetic: TileLang parses -2147483648 as -(2147483648), a literal i32 refuses
        return "(-2147483647 - 1)" if int(value) == -(1 << 31) and dtype.bits == 32 else str(int(value))
    return f'T.float32({float(value)!r})' if dtype.bits == 32 else f'T.cast({float(value)!r}, "{dtype.tilelang_name}")'


_BINARY = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
           "eq": "==", "ne": "!="}
_CALL = {"max": "T.max", "min": "T.min", "and": "T.And", "or": "T.Or", "not": "T.Not", "exp": "T.exp",
         "exp2": "T.exp2", "log": "T.log", "log2": "T.log2", "sqrt": "T.sqrt", "rsqrt": "T.rsqrt",
         "sigmoid": "T.sigmoid", "abs": "T.abs", "where": "T.if_then_else"}


_FLOOR = {"floordiv": "T.floordiv", "mod": "T.floormod"}
_BITS = {"bitand": "T.bitwise_and", "bitor": "T.bitwise_or", "bitxor": "T.bitwise_xor", "shl": "T.shift_left",
         "shr": "T.shift_right"}


def bit_op(kind: str, node: Node, kids: list[str]) -> str:
    """``& | ^ << >>`` on integers (TIR's bitwise intrinsics). CUDA computes a narrower type than
    int32 in int, so a ``u8`` result is cast back: ``(x << 4)`` drops the bits above 8 as the
    interpreter's does."""
    tl = node.dtype.tilelang_name
    if node.dtype.bits != 32:  # index expressions and constants are int32: give them the tile's type
        kids = [f'T.cast({x}, "{tl}")' if c.kind in ("scalar", "const") else x for c, x in zip(node.children, kids)]
    text = f"{_BITS[kind]}({kids[0]}, {kids[1]})"
    return text if node.dtype.bits == 32 else f'T.cast({text}, "{tl}")'


def floor_division(kind: str, node: Node, kids: list[str]) -> str:
    """``//`` / ``%`` on integers with Python's floor semantics (TIR's floordiv / floormod), and the
    DSL's result for a zero divisor (0 for ``//``, the dividend for ``%``) unless the divisor is a
    nonzero constant."""
    a, b = kids
    if node.dtype.bits != 32:  # index expressions are int32: widen them to the tile's type
        a, b = (f'T.cast({x}, "{node.dtype.tilelang_name}")' if c.kind == "scalar" else x
                for c, x in zip(node.children, (a, b)))
    divisor = node.children[1]
    if divisor.kind == "const" and divisor.attr != 0:
        return f"{_FLOOR[kind]}({a}, {b})"
    # the division runs unconditionally (TIR hoists it), so it divides by 1 where b is 0
    zero, one = f'T.cast(0, "{node.dtype.tilelang_name}")', f'T.cast(1, "{node.dtype.tilelang_name}")'
    op = f"{_FLOOR[kind]}({a}, T.if_then_else({b} == {zero}, {one}, {b}))"
    return f"T.if_then_else({b} == {zero}, {zero if kind == 'floordiv' else a}, {op})"


class ElementPrinter:
    """Prints a map's expression for one element. ``read(k, idx)`` gives input k at indices."""

    def __init__(self, read, loop_vars: tuple[str, ...]):
        self.read = read
        self.loop_vars = loop_vars

    def expr(self, node: Node, idx: tuple | None = None) -> str:
        idx = tuple(self.loop_vars) if idx is None else idx
        k = node.kind
        if k == "arg":
            return self.read(node.attr, idx)
        if k == "const":
            return literal(node.attr, node.dtype)
        if k == "scalar":
            return index(node.attr)
        if k == "iota":
            i = idx[node.attr]
            return "0" if i is None else i
        kids = [self.expr(c, child_index(node, c, idx)) for c in node.children]
        if k == "expand":
            return kids[0]
        if k == "cast":
            return f'T.cast({kids[0]}, "{node.attr.tilelang_name}")'
        if k == "neg":
            return f"(-{kids[0]})"
        if k == "bitcast":  # the same bits as another type of the width
            return f'T.reinterpret({kids[0]}, "{node.dtype.tilelang_name}")'
        if k in _BITS:
            return bit_op(k, node, kids)
        if k in _FLOOR:
            return floor_division(k, node, kids)
        if k in _BINARY:
            return f"({kids[0]} {_BINARY[k]} {kids[1]})"
        if k in _CALL:
            return f"{_CALL[k]}({', '.join(kids)})"
        raise UnsupportedError(f"elementwise {k} has no TileLang form")


def atom(e) -> str:
    """An index expression as one operand of ``%``, ``//`` or ``*``: parenthesised unless a
    number or a name (a dynamic tile count is a product: ``tile_id % (8 * T.ceildiv(n_M, 128))``)."""
    text = index(e)
    return text if text.isidentifier() or text.lstrip("-").isdigit() or text.startswith("(") else f"({text})"


def count_div(a, b) -> str:
    """``a // b`` of two counts (a block or tile number, a grid extent: never negative; ``a`` as
    text is a name, a call or a chain of ``//`` / ``%``, which binds as tightly as the result). By a
    dynamic size it is written ``T.truncdiv``, which equals floor division there: TVM cannot see the
    sign of a size read at the call and writes its floor division as a truncating one corrected by
    two sign tests, into every address that uses the result (the block-scaled GEMM's scale loads
    inside its K loop, sm90); by a number, TVM's own ``//`` is a shift or a multiply already."""
    return f"{_left(a)} // {atom(b)}" if _number(b) else f"T.truncdiv({_plain(a)}, {_plain(b)})"


def count_mod(a, b) -> str:
    """``a % b`` of two counts, as ``count_div``."""
    return f"{_left(a)} % {atom(b)}" if _number(b) else f"T.truncmod({_plain(a)}, {_plain(b)})"


def _number(e) -> bool:
    return (e.lstrip("-").isdigit() if isinstance(e, str) else sympy.sympify(e).is_Integer)


def _left(e) -> str:
    return e if isinstance(e, str) else atom(e)


def _plain(e) -> str:
    return e if isinstance(e, str) else index(e)
