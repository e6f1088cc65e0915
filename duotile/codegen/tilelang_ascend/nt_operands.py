"""nt_operands: make every gemm NT (``transpose_a=False, transpose_b=True``), the only form
Ascend's L1 gemm accepts, by loading the offending operand transposed from global memory
(GM -> L1 ``dn2nz``). A lowering rule for any gemm, whatever kernel it came from.

Before (flash attention's P.V, V loaded as [BN, D] and used as K x N)::

    %v8 = load v[b, h, 128*n, 0] -> bf16[128x64] operand
    gemm(%v30, %v8, %buf1) transpose_a=False transpose_b=False

After (the tile is stored N x K in L1; the load carries ``transpose=True``)::

    %v8 = load v[b, h, 128*n, 0] -> bf16[64x128] operand transpose=True
    gemm(%v30, %v8, %buf1) transpose_a=False transpose_b=True

A tile loaded once and used both ways by gemms (the shared K = V rows of MQA decode: ``q K^T``
then ``P K``) is loaded a second time, transposed, for the gemms that need it so; the tile
crosses GM -> L1 twice. An operand that is not a plain load (a vector result), or that other ops
read as-is too, raises UnsupportedError.
"""

from __future__ import annotations

from ...dsl.ir import Module, Op, TileType, Value
from .ir_util import blocks, defining_ops, reads, unsupported


def nt_operands(module: Module) -> Module:
    defs = defining_ops(module)
    users: dict[int, list] = {}
    for op in module.walk():
        for v in reads(op):
            users.setdefault(v.id, []).append(op)
    done: set[int] = set()
    twins: dict[int, Value] = {}  # tile id -> its transposed second load
    for op in list(module.walk()):
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
            if any(u.name != "gemm" for u in uses):
                raise unsupported(f"tile {v!r} is read as-is by a {next(u.name for u in uses if u.name != 'gemm')} "
                                  "and transposed by a gemm; L1 gemm is NT only", op)
            op.attrs[key] = want
            if v.id in done:  # already loaded transposed for an earlier gemm
                continue
            if all(u.args[idx] is v and (u is op or u.attrs[key] != want) for u in uses):  # every use turns it
                src.attrs["transpose"] = True
                v.type = TileType(v.type.shape[::-1], v.type.dtype, v.type.role)
                done.add(v.id)
                continue
            if v.id not in twins:  # also used as-is: a second, transposed load for the gemms that turn it
                twins[v.id] = _transposed_twin(module, src)
            op.args = tuple(twins[v.id] if i == idx else a for i, a in enumerate(op.args))
    return module


def _transposed_twin(module: Module, load: Op) -> Value:
    """A copy of ``load`` that stores its tile transposed in L1, placed right after it."""
    v = load.result
    twin = Value(TileType(v.type.shape[::-1], v.type.dtype, v.type.role), hint=f"{v.hint or 'v'}_t")
    copy = Op("load", load.args, {**load.attrs, "transpose": True}, twin, [], load.loc)
    for block in blocks(module):
        if load in block.ops:
            block.ops.insert(block.ops.index(load) + 1, copy)
            return twin
    raise AssertionError("a load outside the module")
