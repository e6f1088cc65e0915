"""Shared machinery for passes: copy a module while mapping every expression and value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import sympy

from ..dsl.ir import Block, Module, Op, TileType, Value

_LEAVES = frozenset({int, float, str, bool, type(None)})  # attr values that hold no expression


def map_expr(x, fn: Callable[[sympy.Basic], sympy.Basic]):
    """Apply ``fn`` to sympy expressions inside attrs (tuples, lists and dicts included)."""
    if type(x) in _LEAVES:  # most attrs: returned as they are, as the checks below would
        return x
    if isinstance(x, sympy.Basic):
        return fn(x)
    if isinstance(x, tuple):
        return tuple(map_expr(i, fn) for i in x)
    if isinstance(x, list):
        return [map_expr(i, fn) for i in x]
    if isinstance(x, dict):
        return {k: map_expr(v, fn) for k, v in x.items()}
    return x


def substitute(op: Op, old: Value, new: Value) -> None:
    """Make ``op`` and every op in its regions read ``new`` where they read ``old`` (in place)."""
    for o in op.walk():
        o.args = _swap(o.args, old, new)
        o.attrs = _swap(o.attrs, old, new)


def _swap(x, old: Value, new: Value):
    if x is old:
        return new
    if isinstance(x, tuple):
        return tuple(_swap(y, old, new) for y in x)
    if isinstance(x, list):
        return [_swap(y, old, new) for y in x]
    if isinstance(x, dict):
        return {k: _swap(y, old, new) for k, y in x.items()}
    return x


class Rewriter:
    """Copies a module; ``expr`` rewrites every index expression and tile dimension."""

    def __init__(self, expr: Callable[[sympy.Basic], sympy.Basic] = lambda e: e):
        self.expr = expr
        self.values: dict[int, Value] = {}

    def value(self, v: Value) -> Value:
        new = self.values.get(v.id)
        if new is None:
            t = v.type
            new_type = TileType(tuple([self.expr(d) for d in t.shape]), t.dtype, t.role)
            new = self.values[v.id] = Value(new_type, v.mutable, v.hint, v.id)
        return new

    def arg(self, a):
        return self.value(a) if isinstance(a, Value) else map_expr(a, self.expr)

    def op(self, op: Op) -> Op:
        arg = self.arg
        return Op(op.name, tuple([arg(a) for a in op.args]), {k: arg(v) for k, v in op.attrs.items()},
                  self.value(op.result) if op.result is not None else None,
                  [self.block(r) for r in op.regions] if op.regions else [], op.loc)

    def block(self, block: Block) -> Block:
        return Block([self.op(o) for o in block.ops])

    def module(self, m: Module, **changes) -> Module:
        params = [dataclasses.replace(p, shape=tuple(self.expr(d) for d in p.shape)) for p in m.params]
        fields = dict(name=m.name, params=params, body=self.block(m.body), config=dict(m.config),
                      constants=dict(m.constants), shapes=dict(m.shapes), dynamic=m.dynamic, batch_dim=m.batch_dim,
                      source_file=m.source_file, phase=m.phase,
                      requires=[(self.expr(c) if hasattr(c, "free_symbols") else c, msg, loc)
                                for c, msg, loc in m.requires])
        fields.update(changes)
        return Module(**fields)
