"""Axes that ``T.copy`` leaves unguarded: where a tile is one element wide.

TileLang 0.1.15 lowers a ``T.copy`` between a global tensor and a tile to a loop whose reads are
zero-filled, and whose writes are dropped, outside the tensor, but its bounds test
(``CopyNode::MakePredicate``) skips every axis along which the region is one element wide: a
(BM, 1) tile of scale codes at a K block past the last one reads the bytes after the tensor.
``gemm_blockscaled`` with K = 192 and BK = 256 did (the Engram projection of the tiny V4.1,
found by compute-sanitizer's memcheck): the tile's last row read the byte after its 120-byte
scale tensor, a code that is NaN where that byte is 255.

The generators therefore emit such a load or store as a guarded element loop unless the tile's
position along each one-wide axis is proven inside the tensor: its largest value, with every grid
and loop variable at its largest, less than the axis' size (sizes may be symbols: the dynamic M
of a row-wise kernel whose grid has one program a row is proven by its own extent).
"""

from __future__ import annotations

import sympy


def unguarded(e, op) -> list[int]:
    """The tensor axes of ``op`` (a global ``load`` or ``store`` of a tile) that are one element
    wide in the tile and not proven to lie inside the tensor: those ``T.copy`` would leave unread
    by its bounds test."""
    p = e.m.param(op.attrs["tensor"])
    shape, offsets = op.attrs["shape"], op.attrs["offsets"]
    lead = len(p.shape) - len(shape)
    env = _largest_values(e)
    return [d for d, off in enumerate(offsets)
            if d >= lead and int(shape[d - lead]) == 1 and not _inside(sympy.sympify(off), p.shape[d], env)]


def _largest_values(e) -> dict:
    """Each grid and enclosing loop variable's largest value (a sympy expression), or None."""
    env = {v: sympy.sympify(extent) - 1 for v, extent in zip(e.m.grid.attrs["vars"], e.m.grid.attrs["extents"])}
    for loop in e.loop_stack:
        env[sympy.sympify(loop.attrs["var"])] = sympy.sympify(loop.attrs["extent"]) - 1
    return env


def _inside(off, size, env: dict) -> bool:
    if off.free_symbols - set(env):  # a symbol read from data (``dsl.scalar``): nothing proves it
        return False
    hi = largest(off, env)
    if hi is None:
        return False
    slack = sympy.expand(sympy.sympify(size) - 1 - hi)
    return bool(slack.is_nonnegative)


def largest(e, env: dict):
    """The largest value of an index expression that grows with each of its variables (which are
    never negative): sums, products with non-negative numbers, floor and ceiling, min and max of
    such, and a remainder by a positive number; None for anything else."""
    if e.is_Number:
        return e
    if e.is_Symbol:  # a loop's bound may name the variables of the loops and grid around it
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

