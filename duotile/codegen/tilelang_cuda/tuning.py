"""The autotuner's quick estimate of what a config needs on sm90 / sm100 (``Target.tuning_limits``).

From the estimated live tile bytes: operands in shared memory; vector tiles, and on sm90 the
accumulators too, in registers spread over the block's threads; on sm100 accumulators in TMEM.
A register estimate over 255 a thread means spills (the build would still succeed, slowly), so
this is a tuning filter, not a capacity law; ``capacity.py`` is the law at build time.
"""

from __future__ import annotations

import math
from typing import Any

import sympy

from ...dsl.ir import Role
from ...passes.autotune.usage import REG_OVERHEAD, Limit, TileUsage, threads_of
from .arch import Arch


def cuda_limits(arch: Arch, u: TileUsage, knobs: dict[str, Any]) -> list[Limit]:
    threads = threads_of(knobs)
    reg_bytes = u.peak[Role.VECTOR] + (0 if arch.has_tmem else u.peak[Role.ACCUMULATOR])
    per_thread = sympy.ceiling(sympy.Integer(reg_bytes) / 4 / threads) + REG_OVERHEAD
    limits = [Limit("shared memory", sympy.Integer(u.peak[Role.OPERAND]), sympy.Integer(arch.smem_bytes)),
              Limit("registers per thread", per_thread, sympy.Integer(255), "registers"),
              Limit("registers per SM", per_thread * threads, sympy.Integer(64 * 1024), "registers")]
    if arch.has_tmem:
        # an fp32 accumulator of BM x BN takes BN columns per 128 lanes of rows
        cols = sum(s[-1] * math.ceil((math.prod(s[:-1]) or 1) / 128) for s in u.accumulators)
        limits.append(Limit("tensor memory", sympy.Integer(cols), sympy.Integer(arch.tmem_columns), "columns"))
    return limits

