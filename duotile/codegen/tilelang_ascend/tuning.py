"""What the autotuner knows of the Ascend 950 before compiling: the quick estimate of what a
config needs (``Target.tuning_limits``) and the cost model's machine (``Target.machine``).

From the estimated live tile bytes: vector tiles in UB (32 KiB of it reserved once a SIMT
vector region exists), operands in L1, the largest gemm operands in L0A / L0B, accumulators in
L0C. The liveness-based ``assign_memory`` plan (``capacity.py``) is the law at build time.
"""

from __future__ import annotations

from typing import Any

import sympy

from ...dsl.ir import Role
from ...passes.autotune.cost_model import Machine
from ...passes.autotune.usage import KiB, Limit, TileUsage


def ascend_limits(u: TileUsage, knobs: dict[str, Any]) -> list[Limit]:
    ub = (216 if u.has_vector_work else 248) * KiB
    # with vector_split each AIV holds half the rows of the vector tiles (roughly half the UB;
    # assign_memory on the split module is the law)
    vector = u.peak[Role.VECTOR] // (2 if knobs.get("vector_split") else 1)
    return [Limit("UB", sympy.Integer(vector), sympy.Integer(ub)),
            Limit("L1", sympy.Integer(u.peak[Role.OPERAND]), sympy.Integer(512 * KiB)),
            Limit("L0A", sympy.Integer(u.gemm_a), sympy.Integer(64 * KiB)),
            Limit("L0B", sympy.Integer(u.gemm_b), sympy.Integer(64 * KiB)),
            Limit("L0C", sympy.Integer(u.peak[Role.ACCUMULATOR]), sympy.Integer(256 * KiB))]


# every figure is an assumption (passes/autotune/cost_model.py's docstring says where they come from)
ASCEND950 = Machine("Ascend 950 (assumed figures)", 32, {16: 500e12, 8: 1000e12, 32: 125e12}, 40e12, 4.0e12,
                    256 * 1.8e9, 512 * 1024, 0, 1, 1.0e-6, 0.5e-6, 16,
                    "all Ascend 950 figures are assumptions (see passes/autotune/cost_model.py)",
                    acc_in_registers=False, vector_copies=2)
