"""nt_operands: make every gemm NT (``transpose_a=False, transpose_b=True``), the only form
Ascend's L1 gemm accepts, by loading the offending operand transposed from global memory
(GM -> L1 ``dn2nz``). A lowering rule for any gemm, whatever kernel it came from.

Before (flash attention's P.V, V loaded as [BN, D] and used as K x N)::

    %v8 = load v[b, h, 128*n, 0] -> bf16[128x64] operand
    gemm(%v30, %v8, %buf1) transpose_a=False transpose_b=False

After (the tile is stored N x K in L1; the load carries ``transpose=True``)::

    %v8 = load v[b, h, 128*n, 0] -> bf16[64x128] operand transpose=True
    gemm(%v30, %v8, %buf1) transpose_a=False transpose_b=True

An operand that is not a plain load used only by gemms needing the same transpose (for
example a vector result, or a tile also read as-is) raises UnsupportedError.
"""

from __future__ import annotations

from ...dsl.ir import Module, TileType
from .ir_util import defining_ops, reads, unsupported


def nt_operands(module: Module) -> Module:
    defs = defining_ops(module)
    users: dict[int, list] = {}
    for op in module.walk():
        for v in reads(op):
            users.setdefault(v.id, []).append(op)
    done: set[int] = set()
    for op in module.walk():
        if op.name != "gemm":
            continue
        for idx, key, want in ((0, "transpose_a", False), (1, "transpose_b", True)):
            if op.attrs[key] == want:
                continue
            v = op.args[idx]
            src = defs.get(v.id)
            uses = users.get(v.id, [])
            if src is None or src.name != "load" or len(v.type.shape) != 2:
                raise unsupported(f"gemm operand {v!r} needs {key}={want}, and only a 2-d tile loaded from "
                                  "global memory can be transposed on the way into L1", op)
            if v.id not in done:
                if any(u.name != "gemm" or u.args[idx] is not v or u.attrs[key] == want for u in uses):
                    raise unsupported(f"tile {v!r} is used both transposed and as-is; L1 gemm is NT only", op)
                src.attrs["transpose"] = True
                v.type = TileType(v.type.shape[::-1], v.type.dtype, v.type.role)
                done.add(v.id)
            op.attrs[key] = want
    return module
