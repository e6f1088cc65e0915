"""The Ascend 950 (dav-3510) memory model: where each role lives and how big each buffer is.

Capacities are TileLang 0.1.15's (``src/ascend/transform/auto_schedule.cc``):

=====  ========  =====================================================
scope  bytes     note
=====  ========  =====================================================
ub     248 KiB   216 KiB when the kernel has a SimtVF region
l1     512 KiB
l0a    64 KiB    staged internally by T.gemm from L1; TileLang checks it
l0b    64 KiB    idem
l0c    256 KiB   **TileLang does not check it**: only this model does
=====  ========  =====================================================

Roles: operand -> L1, accumulator -> L0C, vector -> UB. A tile produced in a pipelined loop
of S stages costs S buffers: TileLang silently drops to fewer buffers when they do not fit,
so this model rejects such a config instead.
"""

from __future__ import annotations

from ...dsl.ir import Module, Role
from ...passes.memory_model import MemoryModel

KIB = 1024
UB, UB_WITH_SIMT = 248 * KIB, 216 * KIB
# checked in this order: the cube side first (L0C, then L1), then UB
CAPACITIES = {"l0c": 256 * KIB, "l1": 512 * KIB, "l0a": 64 * KIB, "l0b": 64 * KIB, "ub": UB}
LABELS = {"ub": "UB (unified buffer)", "l1": "L1", "l0a": "L0A", "l0b": "L0B", "l0c": "L0C"}
ROLES = {Role.OPERAND: "l1", Role.ACCUMULATOR: "l0c", Role.VECTOR: "ub"}
SIMT_OPS = ("map", "gather")  # what the generator lowers inside a T.SimtVF region


def has_simt_region(module: Module) -> bool:
    return any(op.name in SIMT_OPS or (op.name == "alloc" and op.result.type.role is Role.VECTOR
                                       and op.attrs.get("fill") is not None)
               for op in module.walk())


class AscendMemoryModel(MemoryModel):
    def __init__(self):
        super().__init__("ascend950", dict(ROLES), dict(CAPACITIES), dict(LABELS))

    def capacity(self, scope: str, module: Module) -> int | None:
        if scope == "ub" and has_simt_region(module):
            return UB_WITH_SIMT
        return super().capacity(scope, module)
