"""Whether a tile's position lies inside its tensor, proven from the sizes and loop bounds.

An index expression of a load or store grows with each grid and loop variable it names (they are
never negative, and specs write positions as sums of non-negative multiples of them, floors and
ceilings of such, minima and maxima). Its largest value is the expression with every variable at
its own largest (a loop's bound may name the variables around it, so they are substituted in
turn). Sizes may stay symbols (a dynamic M): the proof holds where ``size - 1 - largest`` is
non-negative for every value of them, which sympy decides from their assumptions.

The generators ask where they cannot mask what lies outside: ``tilelang_cuda/unit_axes.py``
(TileLang's ``T.copy`` leaves one-wide axes unbounded) and ``tilelang_ascend/check_whole_tiles.py``
(Ascend's copies are not masked at all).
"""

from __future__ import annotations

import sympy


def variable_bounds(module, loops=()) -> dict:
    """The largest value of each grid variable of ``module`` and of each loop op in ``loops`` (a
    ``for`` runs its variable up to, not including, its ``extent``)."""
    grid = module.grid
    env = {sympy.sympify(v): sympy.sympify(extent) - 1 for v, extent in zip(grid.attrs["vars"], grid.attrs["extents"])}
    for loop in loops:
        env[sympy.sympify(loop.attrs["var"])] = sympy.sympify(loop.attrs["extent"]) - 1
    return env


def inside(off, width: int, size, env: dict) -> bool:
    """Whether ``width`` elements from ``off`` lie inside an axis of ``size`` for every value of
    the variables ``env`` bounds; False where a symbol is not bounded (an index read from data)."""
    off = sympy.sympify(off)
    if off.free_symbols - set(env):
        return False
    hi = largest(off, env)
    if hi is None:
        return False
    return bool(sympy.expand(sympy.sympify(size) - width - hi).is_nonnegative)


def largest(e, env: dict):
    """The largest value of an index expression (module docstring), or None where it has a form
    this does not bound (a variable with a negative coefficient, a remainder by a symbol)."""
    if e.is_Number:
        return e
    if e.is_Symbol:
        hi = env.get(e)
        return largest(hi, env) if hi is not None and hi.free_symbols & env.keys() else hi
    if isinstance(e, sympy.Mod):
        divisor = e.args[1]
        return divisor - 1 if divisor.is_Number and divisor > 0 else None
    if isinstance(e, sympy.Mul) and any(a.is_Number and a.is_negative for a in e.args):
        return None
    parts = [largest(a, env) for a in e.args]
    if any(x is None for x in parts):
        return None
    if isinstance(e, (sympy.Add, sympy.Mul, sympy.floor, sympy.ceiling, sympy.Min, sympy.Max)):
        return e.func(*parts)
    return None


def read_from_data(off) -> bool:
    """Whether an index holds a symbol read from data (``dsl.scalar``: an expert's id, a sequence's
    slot), whose sign and size nothing proves; sizes, tunables and loop variables are never
    negative."""
    return sympy.sympify(off).is_nonnegative is not True
