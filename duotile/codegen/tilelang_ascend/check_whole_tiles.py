"""check_whole_tiles: Ascend lowers only tiles that divide the tensor dimensions they walk.

A ragged last tile (4096 keys in blocks of 192) would need masked GM copies, which this target
does not emit yet. Checked at lowering, so a tuning sweep prunes such configs with the reason
(instead of counting them as compile failures) and a build names the spec line.
"""

from __future__ import annotations

from ...dsl.ir import Module, Op
from .ir_util import unsupported


def partial_tile(op: Op, param) -> str | None:
    """Why ``op``'s tile does not divide ``param`` (a load / store / gather's tensor), or None."""
    shape = op.attrs["shape"]
    lead = len(param.shape) - len(shape)
    for i, dim in enumerate(param.shape[lead:], start=lead):
        size = int(shape[i - lead])
        if size > 1 and int(dim) % size:
            return (f"partial tile: {param.name} dimension {i} has {int(dim)} elements, not a multiple of the "
                    f"tile's {size}; ragged tiles are not lowered for Ascend yet")
    return None


def check_whole_tiles(module: Module) -> Module:
    for op in module.walk():
        if op.name in ("load", "store", "gather"):
            why = partial_tile(op, module.param(op.attrs["tensor"]))
            if why:
                raise unsupported(why, op)
    return module
