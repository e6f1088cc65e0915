"""mark_short_loops: note each loop that runs at most once at every point of the grid.

A split kernel cuts one loop into a range per grid position. With 10 row blocks over 16
ranges, range ``s`` runs blocks ``5*s//8`` up to ``(5*s + 5)//8``: none or one of them.
TileLang 0.1.15 turns a loop whose trip count it can bound by one into a single,
unconditional pass over the body, so every empty range ran a block that was not its own
(and a trip count of exactly one with a variable start fails its loop-bound analysis). A
generator must not hand it such a loop: it emits a guard and binds the variable once.

The pass evaluates the trip count at every grid point where it depends only on grid
variables of bound extent (static shapes), and marks the loops that never run twice::

    for k < (5*s + 5)//8 start 5*s//8 pipelined(stages=1) { ... }
    ->  the same op with attrs["at_most_once"] = True

A trip count it cannot evaluate (a dynamic size, an enclosing loop's variable) leaves the
loop unmarked: TileLang cannot bound it either.
"""

from __future__ import annotations

import itertools

import sympy

from ..dsl.ir import Block, Module

MAX_POINTS = 1 << 16  # grid points the pass evaluates a trip count at, at most


def mark_short_loops(module: Module) -> Module:
    grid = module.grid
    extents = {v: e for v, e in zip(grid.attrs["vars"], grid.attrs["extents"])}
    _mark(grid.regions[0], extents)
    return module


def _mark(block: Block, extents: dict) -> None:
    for op in block.ops:
        if op.name == "for":
            most = max_trips(op.attrs["start"], op.attrs["extent"], extents)
            if most is not None and most <= 1:
                op.attrs["at_most_once"] = True
        for region in op.regions:
            _mark(region, extents)


def max_trips(start, stop, extents: dict) -> int | None:
    """The largest trip count of ``range(start, stop)`` over the grid, or None if unknown."""
    trips = sympy.sympify(stop) - sympy.sympify(start)
    free = sorted(trips.free_symbols, key=str)
    if any(s not in extents or not sympy.sympify(extents[s]).is_Integer for s in free):
        return None
    sizes = [int(extents[s]) for s in free]
    if sizes and (min(sizes) <= 0 or _product(sizes) > MAX_POINTS):
        return None
    if not free:
        return int(trips)
    fn = sympy.lambdify(free, trips, modules=[{"floor": _floor, "ceiling": _ceil}, "math"])
    return max(int(fn(*point)) for point in itertools.product(*(range(n) for n in sizes)))


def _product(sizes: list[int]) -> int:
    out = 1
    for n in sizes:
        out *= n
    return out


def _floor(x):
    return int(sympy.floor(x)) if isinstance(x, sympy.Basic) else int(x // 1)


def _ceil(x):
    return -_floor(-x)
