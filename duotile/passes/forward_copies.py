"""forward_copies: let users read a tile directly instead of a plain copy of it.

A ``map`` whose expression is just ``$0`` (same shape, same dtype) makes a copy. Masks that
``fold_bounds`` removed leave such copies behind, e.g. attention's masked scores once the
mask is known to hold everywhere. Where vector code can read the source where it lives (sm90:
accumulators are register fragments; sm100: the generator drains a TMEM accumulator into a
fragment once after each write), the copy is dropped and its users read the source, provided
nothing writes the source between the copy and its last use.

Before::

    gemm(%q, %k, %buf9)
    %v14 = map(%buf9) { $0 } -> f32[128x128] vector
    %v15 = reduce.max(%v14) axis=1

After::

    gemm(%q, %k, %buf9)
    %v15 = reduce.max(%buf9) axis=1

A target runs this pass only when its generator reads accumulators that way; Ascend moves an
accumulator (L0C) to UB with explicit ops before vector code reads it, so it does not.
"""

from __future__ import annotations

from ..dsl.ir import Block, Module, Op, Value
from .rewrite import substitute


def forward_copies(module: Module) -> Module:
    for op in module.walk():
        for region in op.regions:
            _forward_block(region)
    return module


def _is_copy(op: Op) -> bool:
    e = op.attrs.get("expr") if op.name == "map" else None
    if e is None or op.attrs.get("into") is not None or op.result is None or e.kind != "arg":
        return False
    src = op.args[e.attr]
    return src.type.shape == op.result.type.shape and src.type.dtype == op.result.type.dtype


def _forward_block(block: Block) -> None:
    i = 0
    while i < len(block.ops):
        op = block.ops[i]
        if _is_copy(op):
            src, dst = op.args[op.attrs["expr"].attr], op.result
            users = [j for j in range(i + 1, len(block.ops)) if _reads(block.ops[j], dst)]
            last = users[-1] if users else i
            if not any(src.id in o.written_ids() for o in block.ops[i + 1:last + 1]):
                for o in block.ops[i + 1:last + 1]:
                    substitute(o, dst, src)
                del block.ops[i]
                continue
        i += 1


def _values_in(x):
    if isinstance(x, Value):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _values_in(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _values_in(y)


def _reads(op: Op, v: Value) -> bool:
    return any(x is v for o in op.walk() for x in [*_values_in(o.args), *_values_in(o.attrs)])
