"""Axes that ``T.copy`` leaves unguarded: where a tile is one element wide.

TileLang 0.1.15 lowers a ``T.copy`` between a global tensor and a tile to a loop whose reads are
zero-filled, and whose writes are dropped, outside the tensor, but its bounds test
(``CopyNode::MakePredicate``) skips every axis along which the region is one element wide: a
(BM, 1) tile of scale codes at a K block past the last one reads the bytes after the tensor.
``gemm_blockscaled`` with K = 192 and BK = 256 did (the Engram projection of the tiny V4.1,
found by compute-sanitizer's memcheck): the tile's last row read the byte after its 120-byte
scale tensor, a code that is NaN where that byte is 255.

The generators therefore emit such a load or store as a guarded element loop unless the tile's
position along each one-wide axis, the leading axes the tile does not span among them (a region
one element wide there too), is proven inside the tensor (``codegen/tile_bounds.py``: the
dynamic M of a row-wise kernel whose grid has one program a row is proven by its own extent).
"""

from __future__ import annotations

from ..tile_bounds import inside, read_from_data, variable_bounds


def unguarded(e, op) -> list[int]:
    """The tensor axes of ``op`` (a global ``load`` or ``store`` of a tile, emitted by ``e`` inside
    its current loops) that are one element wide in the tile and not proven to lie inside the
    tensor: those ``T.copy`` would leave unbounded. A leading index read from data (an expert's
    id) is the spec's promise and stays a ``T.copy``: a guarded loop would cost a gathered weight
    tile its TMA copy."""
    p = e.m.param(op.attrs["tensor"])
    shape, offsets = op.attrs["shape"], op.attrs["offsets"]
    lead = len(p.shape) - len(shape)
    env = variable_bounds(e.m, e.loop_stack)
    return [d for d, off in enumerate(offsets)
            if (d < lead and not read_from_data(off) or d >= lead and int(shape[d - lead]) == 1)
            and not inside(off, 1, p.shape[d], env)]

