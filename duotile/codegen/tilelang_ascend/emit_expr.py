"""Printing index math (sympy) and map expression trees (dsl.expr.Node) as TileLang text."""

from __future__ import annotations

import math

import sympy

from ...dsl.dtypes import DType
from ...dsl.expr import Node, child_index

INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
         "eq": "==", "ne": "!="}
CALLS = {"max": "T.max", "min": "T.min", "exp": "T.exp", "exp2": "T.exp2", "log": "T.log", "log2": "T.log2",
         "sqrt": "T.sqrt", "rsqrt": "T.rsqrt", "abs": "T.abs"}


def index(e, names: dict[str, str]) -> str:
    """An integer sympy expression over loop variables as TIR text."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return names[str(e)]
    if isinstance(e, (sympy.Min, sympy.Max)):
        fn = "T.min" if isinstance(e, sympy.Min) else "T.max"
        args = [index(a, names) for a in e.args]
        out = args[0]
        for a in args[1:]:
            out = f"{fn}({out}, {a})"
        return out
    if isinstance(e, (sympy.ceiling, sympy.floor)):
        num, den = sympy.fraction(sympy.together(e.args[0]))
        if not den.is_Integer:
            raise ValueError(f"cannot lower {e}: non-constant divisor")
        n, d = index(sympy.expand(num), names), int(den)
        if d == 1:
            return n
        # parenthesised whole: ``-1*floor(x/8)`` must not print as ``-1*(x) // 8``
        return f"(({n} + {d - 1}) // {d})" if isinstance(e, sympy.ceiling) else f"(({n}) // {d})"
    if isinstance(e, sympy.Mod):
        return f"(({index(e.args[0], names)}) % {index(e.args[1], names)})"  # whole: 64*Mod(x, 2) is not (64*x) % 2
    if e.is_Pow and e.exp.is_Integer and e.exp > 0:  # sympy's rewrites make them: Mod(64*x, 128) is 64*Mod(x**2, 2)
        return "(" + " * ".join([f"({index(e.base, names)})"] * int(e.exp)) + ")"
    if e.is_Add:
        terms = [index(a, names) for a in e.args]
        return "(" + " + ".join(terms) + ")"
    if e.is_Mul:
        num, den = sympy.fraction(e)
        if den != 1:
            return f"({index(num, names)}) // {index(den, names)}"
        return "*".join(index(a, names) if not a.is_Add else f"({index(a, names)})" for a in e.args)
    raise ValueError(f"cannot lower index expression {e} ({type(e).__name__})")


def const(value, dtype: DType) -> str:
    tl = dtype.tilelang_name if dtype.is_float or dtype.name in ("i32", "i64") else "float32"
    if isinstance(value, float) and math.isinf(value):
        return ("-" if value < 0 else "") + f'T.infinity("{tl}")'
    if dtype.is_float:
        return f"T.{tl}({float(value)!r})"
    return f"T.{tl}({int(value)})"


def floor_division(kind: str, node: Node, parts: list[str]) -> str:
    """``//`` / ``%`` on integers: TIR's floordiv / floormod (Python's floor semantics), and for a zero
    divisor the DSL's result (0 for ``//``, the dividend for ``%``) unless it is a nonzero constant."""
    a, b = parts
    if node.dtype.bits != 32:  # index expressions are int32: widen them to the tile's type
        a, b = (f'T.cast({x}, "{node.dtype.tilelang_name}")' if c.kind == "scalar" else x
                for c, x in zip(node.children, (a, b)))
    divisor = node.children[1]
    if divisor.kind == "const" and divisor.attr != 0:
        return f"{'T.floordiv' if kind == 'floordiv' else 'T.floormod'}({a}, {b})"
    # the division runs unconditionally (TIR hoists it), so it divides by 1 where b is 0
    zero, one = const(0, node.dtype), const(1, node.dtype)
    op = f"{'T.floordiv' if kind == 'floordiv' else 'T.floormod'}({a}, T.if_then_else({b} == {zero}, {one}, {b}))"
    return f"T.if_then_else({b} == {zero}, {zero if kind == 'floordiv' else a}, {op})"


BITS = {"bitand": "T.bitwise_and", "bitor": "T.bitwise_or", "bitxor": "T.bitwise_xor", "shl": "T.shift_left",
        "shr": "T.shift_right"}


def bit_op(kind: str, node: Node, parts: list[str]) -> str:
    """``& | ^ << >>`` on integers; a result narrower than int32 is cast back to its type, so
    ``u8 << 4`` drops the bits above 8 as in the interpreter."""
    text = f"{BITS[kind]}({parts[0]}, {parts[1]})"
    return text if node.dtype.bits == 32 else f'T.cast({text}, "{node.dtype.tilelang_name}")'


class ExprPrinter:
    """Prints a map's expression tree for one element; ``args`` are buffer names of the inputs."""

    def __init__(self, args: list[str], names: dict[str, str]):
        self.args = args
        self.names = names

    def __call__(self, node: Node, idx: tuple[str, ...], ctx: DType | None = None) -> str:
        k = node.kind
        if k == "arg":
            sub = ", ".join(idx) if idx else "0"
            return f"{self.args[node.attr]}[{sub}]"
        if k == "const":
            return const(node.attr, ctx or node.dtype)
        if k == "scalar":
            return index(node.attr, self.names)
        if k == "iota":
            return idx[node.attr]
        kids = [self.child(node, c, idx) for c in node.children]
        if k == "expand":
            return self(node.children[0], kids[0])
        if k == "cast":
            return f'T.cast({self(node.children[0], kids[0])}, "{node.attr.tilelang_name}")'
        if k == "bitcast":
            return f'T.reinterpret({self(node.children[0], kids[0])}, "{node.dtype.tilelang_name}")'
        data = [c for c in node.children if c.kind != "const"]
        ctx_dtype = data[0].dtype if data else node.dtype
        if k in ("and", "or"):
            ctx_dtype = None
        if k == "where":
            c, a, b = (self(ch, i, node.dtype) for ch, i in zip(node.children, kids))
            return f"T.if_then_else({c}, {a}, {b})"
        parts = [self(c, i, ctx_dtype) for c, i in zip(node.children, kids)]
        if k in ("floordiv", "mod"):
            return floor_division(k, node, parts)
        if k in BITS:  # constants in the tile's own integer type (``const`` prints narrow ones as floats)
            parts = [f"T.{node.dtype.tilelang_name}({int(c.attr)})" if c.kind == "const" else p
                     for c, p in zip(node.children, parts)]
            return bit_op(k, node, parts)
        if k in INFIX:
            return f"({parts[0]} {INFIX[k]} {parts[1]})"
        if k in CALLS:
            return f"{CALLS[k]}({', '.join(parts)})"
        if k == "and":
            return f"({parts[0]} and {parts[1]})"
        if k == "or":
            return f"({parts[0]} or {parts[1]})"
        if k == "not":
            return f"(not {parts[0]})"
        if k == "neg":
            return f"(-{parts[0]})"
        if k == "sigmoid":
            one = const(1.0, node.dtype)
            return f"({one} / ({one} + T.exp(-{parts[0]})))"
        raise NotImplementedError(k)

    @staticmethod
    def child(node: Node, c: Node, idx: tuple[str, ...]) -> tuple[str, ...]:
        if c.kind in ("const", "scalar"):
            return ()
        return tuple("0" if i is None else i for i in child_index(node, c, idx))
