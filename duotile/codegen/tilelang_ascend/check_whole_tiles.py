"""check_whole_tiles: Ascend lowers only whole tiles that lie inside the tensors they walk.

A ragged last tile (4096 keys in blocks of 192) would need masked GM copies, which this target
does not emit yet; nor does it mask a whole tile whose position runs past the tensor (a K step of
256 columns over K = 192 in 32-column sub-blocks: the last two lie past K), so such a position
must be proven inside from the sizes and loop bounds (``codegen/tile_bounds.py``). Checked at
lowering, so a tuning sweep prunes such configs with the reason (instead of counting them as
compile failures) and a build names the spec line.
"""

from __future__ import annotations

import sympy

from ...dsl.ir import Module, Op
from ..tile_bounds import inside, variable_bounds
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


def past_the_end(op: Op, param, env: dict) -> str | None:
    """Why ``op``'s tile may lie past the end of ``param`` along an axis it walks, or None."""
    shape, offsets = op.attrs["shape"], op.attrs["offsets"]
    lead = len(param.shape) - len(shape)
    for i, (off, dim) in enumerate(zip(offsets, param.shape)):
        if (op.name == "gather" and i == op.attrs["axis"]) or sympy.sympify(off).free_symbols - env.keys():
            continue  # rows named by data, or an index read from data (refused apart). Not
            # tile_bounds.read_from_data, which also counts an index that may be negative: that one
            # CUDA guards at both ends, and here it must be proven inside (``inside`` below) or refused
        size = 1 if i < lead else int(shape[i - lead])  # a point index: one element wide
        if not inside(off, size, dim, env):
            return (f"partial tile: {param.name} dimension {i} ({int(dim)} elements) is read or written at {off} "
                    f"for {size}, which the loop bounds do not keep inside; masked copies are not lowered for "
                    f"Ascend yet")
    return None


def check_whole_tiles(module: Module) -> Module:
    _check(module, module.grid.regions[0].ops, ())
    return module


def _check(module: Module, ops, loops: tuple) -> None:
    for op in ops:
        if op.name in ("load", "store", "gather"):
            param = module.param(op.attrs["tensor"])
            why = partial_tile(op, param) or past_the_end(op, param, variable_bounds(module, loops))
            if why:
                raise unsupported(why, op)
        inner = (*loops, op) if op.name == "for" else loops
        for region in op.regions:
            _check(module, region.ops, inner)
