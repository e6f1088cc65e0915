"""fold_bounds: drop mask conditions that the bound sizes prove always true (or false).

Kernels are written for any size, so a tile loop carries masks such as ``cols < S``. Once
``bind_shapes`` has fixed ``S``, many of them can be decided from the ranges of the loop
variables and of the tile positions: with ``S = 4096`` and ``BN = 128``, ``n*128 + j < 4096``
holds for every ``n < 32`` and ``j < 128``. The check then costs a compare and a select per
element of every tile for nothing; in attention that is the whole score tile, each step.

The pass walks the module with an interval for every index variable, evaluates comparisons
inside ``map`` expression trees by interval arithmetic, and rewrites::

    where(c, x, y)  ->  x  when c is always true,  y  when always false
    and(c, d)       ->  d  when c is always true   (and symmetrically; ``or`` likewise)

Before (S = 4096, BN = 128)::

    map(%s) { where(lt(add(128*n, expand0(iota0)), 4096), mul($0, 0.127), -inf) }

After::

    map(%s) { mul($0, 0.127) }

A replacement must keep the node's shape and dtype; otherwise the node stays. Conditions
it cannot decide (ragged sizes, the causal diagonal) stay as they are.
"""

from __future__ import annotations

import math
from dataclasses import replace

import sympy

from ..dsl.expr import Node
from ..dsl.ir import Block, Module

Interval = tuple[float, float]
_CMP = {"lt", "le", "gt", "ge"}


def fold_bounds(module: Module) -> Module:
    _fold_block(module.grid.regions[0], grid_env(module.grid))
    return module


def grid_env(grid) -> dict:
    """The interval of every grid variable: 0 up to its extent less one."""
    return {v: (0, _hi(e, {}) - 1) for v, e in zip(grid.attrs["vars"], grid.attrs["extents"])}


def _hi(extent, env) -> float:
    iv = interval(extent, env)
    return iv[1] if iv else math.inf


def _fold_block(block: Block, env: dict) -> None:
    for op in block.ops:
        if op.name == "map":
            op.attrs["expr"] = fold_node(op.attrs["expr"], env)
        elif op.name == "for":
            # the loop runs from start up to (not including) its "extent", the end bound
            start = interval(op.attrs["start"], env) or (-math.inf, math.inf)
            inner = {**env, op.attrs["var"]: (start[0], _hi(op.attrs["extent"], env) - 1)}
            for region in op.regions:
                _fold_block(region, inner)
        else:
            for region in op.regions:
                _fold_block(region, env)


def interval(e, env: dict) -> Interval | None:
    """Bounds [lo, hi] of a sympy index expression, or None when they are unknown."""
    if not isinstance(e, sympy.Basic):
        return (e, e) if isinstance(e, (int, float)) else None
    if e.is_Number:
        return (float(e), float(e))
    if e.is_Symbol:
        return env.get(e)
    parts = [interval(a, env) for a in e.args]
    if any(p is None for p in parts):
        return None
    if isinstance(e, sympy.Add):
        return (sum(p[0] for p in parts), sum(p[1] for p in parts))
    if isinstance(e, sympy.Mul):
        out = parts[0]
        for p in parts[1:]:
            out = _mul(out, p)
        return out
    monotone = {sympy.floor: math.floor, sympy.ceiling: math.ceil}
    for fn, f in monotone.items():
        if isinstance(e, fn):
            lo, hi = parts[0]
            return (_apply(f, lo), _apply(f, hi))
    if isinstance(e, (sympy.Min, sympy.Max)):
        pick = min if isinstance(e, sympy.Min) else max
        return (pick(p[0] for p in parts), pick(p[1] for p in parts))
    return None


def _apply(f, x: float) -> float:
    return x if math.isinf(x) else f(x)


def _mul(a: Interval, b: Interval) -> Interval:
    corners = [x * y for x in a for y in b if not (math.isinf(x) and y == 0 or math.isinf(y) and x == 0)]
    return (min(corners, default=0.0), max(corners, default=0.0))


def node_interval(node: Node, env: dict) -> Interval | None:
    """Bounds of an integer-valued expression node over every element and loop iteration."""
    k = node.kind
    if k == "const":
        return (node.attr, node.attr) if isinstance(node.attr, (int, float)) else None
    if k == "scalar":
        return interval(node.attr, env)
    if k == "iota":  # a size not bound yet (a module the knob filter reads before binding) is unknown
        n = node.shape[0]
        return (0, int(n) - 1) if getattr(n, "is_Integer", isinstance(n, int)) else None
    if k in ("expand", "cast"):
        return node_interval(node.children[0], env)
    if k not in ("add", "sub", "mul", "max", "min"):
        return None
    a, b = (node_interval(c, env) for c in node.children)
    if a is None or b is None:
        return None
    if k == "add":
        return (a[0] + b[0], a[1] + b[1])
    if k == "sub":
        return (a[0] - b[1], a[1] - b[0])
    if k == "mul":
        return _mul(a, b)
    pick = max if k == "max" else min
    return (pick(a[0], b[0]), pick(a[1], b[1]))


def truth(node: Node, env: dict) -> bool | None:
    """True / False when a condition node has that value everywhere, else None."""
    k = node.kind
    if k in _CMP:
        a, b = (node_interval(c, env) for c in node.children)
        if a is None or b is None:
            return None
        always = {"lt": a[1] < b[0], "le": a[1] <= b[0], "gt": a[0] > b[1], "ge": a[0] >= b[1]}[k]
        never = {"lt": a[0] >= b[1], "le": a[0] > b[1], "gt": a[1] <= b[0], "ge": a[1] < b[0]}[k]
        return True if always else (False if never else None)
    if k in ("and", "or"):
        parts = [truth(c, env) for c in node.children]
        decisive = k == "or"  # the value that decides the whole: True for or, False for and
        if decisive in parts:
            return decisive
        return (not decisive) if all(p is not None for p in parts) else None
    return None


def fold_node(node: Node, env: dict) -> Node:
    kids = tuple(fold_node(c, env) for c in node.children)
    node = replace(node, children=kids) if kids != node.children else node
    if node.kind == "where":
        t = truth(kids[0], env)
        if t is not None:
            return _same_type(node, kids[1] if t else kids[2])
    elif node.kind in ("and", "or"):
        keep_if = node.kind == "and"  # a side that is always this value can be dropped
        for side, other in ((kids[0], kids[1]), (kids[1], kids[0])):
            if truth(side, env) is keep_if:
                return _same_type(node, other)
    return node


def _same_type(node: Node, candidate: Node) -> Node:
    ok = tuple(candidate.shape) == tuple(node.shape) and candidate.dtype == node.dtype
    return candidate if ok else node
