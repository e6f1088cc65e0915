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
fill 256 threads keeps 256. So does a launch of fixed size (a bucketed batch) that the default
block already runs in one wave (programs x 256 threads within what the SMs hold at once,
``Arch.resident_threads``): such a launch is a latency chain, which more threads with fewer
elements each shorten. V4.1's SwiGLU at 64 decode tokens (384 routed rows) is 864 programs of an
8 x 32 tile: 221,184 threads at 256, one wave on 132 SMs; on one warp each it ran 1.3x slower
(below). A build that serves every value of a dynamic size (a decode step's batch and a prefill
chunk's tokens alike) takes the rule as a prefill chunk would, where its time goes; at a decode
step's few rows it is unmeasured.

Measured (H100, 2026-12-07, ``benchmarks/ab_checkouts.py`` against the code before the rule, one
round, 15 calls each after an L2 flush, outputs checked against the references; the one-wave
condition was added after it, from its last row):

| shape | 256 threads | fitted | |
|---|---|---|---|
| swiglu_quant v41/experts_i2304/prefill4096 | 177.0 us | 161.0 us (64) | 1.10x |
| quantize v41/k5120/prefill4096 | 47.2 us | 40.7 us (64) | 1.16x |
| kv_round v41/window_fp8_32_d512/prefill4096 | 34.6 us | 14.1 us (32) | 2.45x |
| rope v41/q_h64_d512/prefill4096 | 349.1 us | 324.5 us (64) | 1.08x |
| hc_post v41/site_d5120/prefill4096 | 151.6 us | 130.7 us (128) | 1.16x |
| swiglu_quant v41/experts_i2304/decode64 | 7.9 us | 10.3 us (32) | 0.77x: now kept at 256 |

Batch invariance holds: a dynamic build keeps one block for every batch, and a bucketed kernel
(whose buckets may get different blocks) reduces by max and min alone, which
``check_batch_invariance`` enforces and whose result no order changes. A sum's last bits may differ
from a 256-thread build's, since the block's threads split a row and so order its sum; each
kernel's tolerance against its reference covers that, as for any other config.
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
            if value is None:
                continue
            size = sympy.sympify(value.type.numel())
            if not size.is_Integer:
                return None
            most = max(most, int(size))
    return most


def thread_choices(phases: list[Module], default: int, programs: int | None = None,
                   resident_threads: int = 0) -> list[int]:
    """``threads`` values to try for these bound phases, preferred first; empty where the rule
    keeps ``default`` (a gemm, tiles that fill ``default`` threads, or a launch of ``programs``
    blocks, known where the build's sizes are fixed, that a chip holding ``resident_threads``
    threads at once runs in one wave of ``default``-thread blocks)."""
    most = largest_tile(phases)
    if not most:
        return []
    fits = [t for t in CHOICES if t <= default and most >= PER_THREAD * t]
    best = fits[0] if fits else CHOICES[-1]
    if best >= default or (programs is not None and programs * default <= resident_threads):
        return []
    return [t for t in reversed(CHOICES) if best <= t < default]
