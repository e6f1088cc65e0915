"""What the autotuner knows of sm90 / sm100 before compiling: the quick estimate of what a config
needs (``Target.tuning_limits``) and the roofline machine of the cost model (``Target.machine``).

From the estimated live tile bytes: operands in shared memory; vector tiles, and on sm90 the
accumulators too, in registers spread over the block's threads (the most live at one moment);
on sm100 accumulators in TMEM.
A register estimate over 255 a thread means spills (the build would still succeed, slowly), so
this is a tuning filter, not a capacity law; ``capacity.py`` is the law at build time.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import sympy

from ...dsl.ir import Role
from ...passes.autotune.cost_model import Machine
from ...passes.autotune.usage import REG_OVERHEAD, Limit, TileUsage, threads_of
from .arch import SM90, SM100, Arch


def cuda_limits(arch: Arch, u: TileUsage, knobs: dict[str, Any]) -> list[Limit]:
    threads = threads_of(knobs)
    # on sm100 a rewritten accumulator is a register tile (plan.product_tile), the others TMEM
    kept = sum(math.prod(s) * 4 for s in u.rewritten)
    reg_bytes = u.peak[Role.VECTOR] + kept if arch.has_tmem else u.peak_acc_vector
    per_thread = sympy.ceiling(sympy.Integer(reg_bytes) / 4 / threads) + REG_OVERHEAD
    limits = [Limit("shared memory", sympy.Integer(u.peak[Role.OPERAND]), sympy.Integer(arch.smem_bytes)),
              Limit("registers per thread", per_thread, sympy.Integer(255), "registers"),
              Limit("registers per SM", per_thread * threads, sympy.Integer(64 * 1024), "registers")]
    if arch.has_tmem:
        # an fp32 accumulator of BM x BN takes BN columns per 128 lanes of rows; the rewritten ones
        # (in registers) one fresh product tile a shape, which the gemms into them share
        tiles = list((Counter(u.accumulators) - Counter(u.rewritten)).elements()) + sorted(set(u.rewritten))
        cols = sum(s[-1] * math.ceil((math.prod(s[:-1]) or 1) / 128) for s in tiles)
        limits.append(Limit("tensor memory", sympy.Integer(cols), sympy.Integer(arch.tmem_columns), "columns"))
    return limits



# figures: reference/kernels.md section 1; the rest are stated assumptions
MACHINES = {
    "sm90": Machine("H200 SXM", 132, {16: 989e12, 8: 1979e12, 32: 67e12}, 67e12, 4.8e12,
                    128 * 1.83e9, 228 * 1024, 65536, 32, 1.3e-6, 0.3e-6, 64,
                    "wgmma m64 per warpgroup; smem 128 B/clk/SM at 1.83 GHz, 15% L2 miss: assumptions; "
                    "1.3 us a pipeline step's wait under load: measured (a decode GEMM, 2026-12-01)",
                    pipelined_resident=1, threads_per_unit=SM90.threads_per_sm),
    "sm100": Machine("B200", 148, {16: 2250e12, 8: 4500e12, 32: 80e12}, 80e12, 8.0e12,
                     128 * 1.9e9, 228 * 1024, 65536, 32, 0.7e-6, 0.3e-6, 128,
                     "tcgen05 m128; vector rate, smem bandwidth, latency: assumptions", acc_in_registers=False,
                     threads_per_unit=SM100.threads_per_sm),
}
