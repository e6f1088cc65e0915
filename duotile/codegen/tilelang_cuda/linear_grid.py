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
    (``names`` and ``extents`` outermost first). An axis of extent 1 is 0; an axis takes a modulo
    only below an axis of another extent. A decode by a dynamic size is computed once, into a
    register (``T.alloc_var``): TileLang inlines a bound expression into every use, and nvcc
    recomputed its division, in 64 bits, in every address of the loop body that used it (the
    block-scaled GEMM ran 2.3x slower at V4's wq_b than on its own grid axes)."""
    ext = [sympy.sympify(x) for x in extents]
    lines = [f"with T.Kernel({index(sympy.Mul(*ext))}, threads={threads}) as ({LINEAR},):"]
    inner = sympy.Integer(1)
    for k in range(len(names) - 1, -1, -1):
        if ext[k] == 1:
            lines.append(f"    {names[k]} = 0")
            continue
        at = LINEAR if inner == 1 else count_div(LINEAR, inner)
        wraps = any(x != 1 for x in ext[:k])
        value = count_mod(at, ext[k]) if wraps else at
        dynamic = not sympy.sympify(inner).is_Integer or (wraps and not ext[k].is_Integer)
        lines.append(f"    {names[k]} = " + (f'T.alloc_var("int32", init={value})' if dynamic else value))
        inner *= ext[k]
    return lines
