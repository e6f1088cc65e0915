"""Blocks sized to their tiles, for CUDA kernels without a gemm: the ``threads`` a config gets when
nothing chose one (the cost model's pick for a call, ``choose_config.ranked_configs``).

TileLang spreads each register tile over the block's threads. A block of 256 threads working on a
16 x 32 tile (V4.1's SwiGLU + FP8 quantiser, one 32-wide scale block of 16 rows a trip) holds two
elements a thread, so each global load is 4 bytes and each FP8 store 2; the same tile over 64
threads is one 16-byte load a thread (``uint4``) and an 8-byte store, a quarter of the load
instructions for the same bytes, and a block resident four times as often on an SM (a Hopper SM
holds at most 32 blocks and 2,048 threads). The generated code shows it:
``duotile show swiglu_quant --case v41/experts_i2304/prefill4096 --stage cuda --config threads=64``.

The rule: the largest block of ``CHOICES`` (at most the target's default, 256) whose threads each
hold at least ``PER_THREAD`` elements of the phase's largest tile, else one warp; the values above
it follow as fallbacks, in case the target's checks refuse one (a reduction over 96 elements does
not split over 64 threads). A kernel with a gemm keeps its warp groups, and a kernel whose tiles
fill 256 threads keeps 256. Bits do not change: a reduction's order is the tile's, not the
block's (TileLang reduces a row within a thread first, then across threads by a fixed butterfly;
``check_batch_invariance`` holds for every value).
"""

from __future__ import annotations

import sympy

from ...dsl.ir import Module

PER_THREAD = 8  # elements of the largest tile a thread holds at least: 16 bytes of BF16
CHOICES = (256, 128, 64, 32)  # threads per block, largest first; 32: one warp


def largest_tile(phases: list[Module]) -> int | None:
    """Elements of the largest static tile any op of ``phases`` makes or moves; None where a phase
    has a gemm (its block is whole warp groups) or a tile's size is not a number."""
    most = 0
    for module in phases:
        for op in module.walk():
            if op.name == "gemm":
                return None
            value = op.result if op.result is not None else (op.args[0] if op.name in ("store", "scatter") else None)
            if value is None or not hasattr(value.type, "shape"):
                continue
            size = sympy.sympify(sympy.Mul(*value.type.shape))
            if not size.is_Integer:
                return None
            most = max(most, int(size))
    return most


def thread_choices(phases: list[Module], default: int) -> list[int]:
    """``threads`` values to try for these bound phases, preferred first; empty where the rule
    keeps ``default`` (a gemm, or tiles that fill ``default`` threads)."""
    most = largest_tile(phases)
    if not most:
        return []
    fits = [t for t in CHOICES if t <= default and most >= PER_THREAD * t]
    best = fits[0] if fits else CHOICES[-1]
    if best >= default:
        return []
    return [t for t in reversed(CHOICES) if best <= t < default]
