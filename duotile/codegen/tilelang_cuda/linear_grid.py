"""A grid whose outer axes may pass CUDA's limit is launched as one linear axis.

CUDA launches at most 65,535 blocks along ``blockIdx.y`` and ``blockIdx.z``, and 2^31 - 1 along
``blockIdx.x``. The generator maps a spec's innermost grid axis to ``x`` and the outer ones to
``y`` and ``z``; an outer axis over the limit fails at launch (``CUDA_ERROR_INVALID_VALUE``), and an
outer axis of dynamic extent (a token count) may pass it at some call. Such a grid is launched as
``prod(extents)`` blocks along ``x`` and the grid variables are decoded from the linear block
number, innermost axis fastest: the order in which the hardware walks a grid, so nothing but the
limit changes. A grid whose outer axes are all known to fit keeps its axes (and with ``raster``,
``T.use_swizzle``, which remaps block indices itself).
"""

from __future__ import annotations

import sympy

from .exprs import count_div, count_mod, index

MAX_OUTER = 65535  # blocks along blockIdx.y and blockIdx.z
LINEAR = "grid_id"


def needs_linear_grid(extents: list) -> bool:
    """True when an outer axis (all but the last, innermost) may exceed ``MAX_OUTER``: larger
    than it, or an expression of dynamic sizes, which no build can bound."""
    for x in extents[:-1]:
        x = sympy.sympify(x)
        if not x.is_Integer or int(x) > MAX_OUTER:
            return True
    return False


def linear_head(names: list[str], extents: list, threads: int) -> list[str]:
    """The kernel's launch line over one axis and the lines that bind each grid variable
    (``names`` and ``extents`` outermost first)."""
    ext = [sympy.sympify(x) for x in extents]
    lines = [f"with T.Kernel({index(sympy.Mul(*ext))}, threads={threads}) as ({LINEAR},):"]
    inner = sympy.Integer(1)
    for k in range(len(names) - 1, -1, -1):
        at = LINEAR if inner == 1 else count_div(LINEAR, inner)
        lines.append(f"    {names[k]} = {count_mod(at, ext[k]) if k else at}")
        inner *= ext[k]
    return lines
