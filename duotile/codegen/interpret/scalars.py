"""Index math for the interpreter: a sympy index expression as a Python function of its symbols,
and, for the integer forms the DSL writes (sums, products, floor and ceiling of quotients, Mod,
Min, Max), as exact integer ops over the tensors of a batch's per-program values."""

from __future__ import annotations

import math
from functools import lru_cache

import sympy
import torch


@lru_cache(maxsize=4096)
def python_form(expr: sympy.Basic) -> tuple:
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
def integer_form(expr: sympy.Basic):
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
