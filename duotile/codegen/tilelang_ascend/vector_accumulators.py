"""vector_accumulators: a gemm accumulator that vector code also writes (or that the author
gave the vector role) cannot live in L0C, which only the cube unit writes. It becomes a
vector (UB) buffer, and each gemm into it becomes "gemm into a fresh L0C tile, move it to UB,
add it into the buffer". A lowering rule for any kernel.

Before (flash attention's output accumulator, rescaled every iteration)::

    %buf1 = alloc() fill=0.0 -> f32[64x128] accumulator
    for n < 8 pipelined(stages=2) {
      map(%buf1, %v24) { mul($0, expand1($1)) } into %buf1
      gemm(%v30, %v8, %buf1) transpose_a=False transpose_b=True
    }

After::

    %buf1 = alloc() fill=0.0 -> f32[64x128] vector
    for n < 8 pipelined(stages=2) {
      map(%buf1, %v24) { mul($0, expand1($1)) } into %buf1
      %acc40 = alloc() fill=0.0 -> f32[64x128] accumulator
      gemm(%v30, %v8, %acc40) transpose_a=False transpose_b=True
      %acc40_vec41 = move(%acc40) -> f32[64x128] vector
      map(%buf1, %acc40_vec41) { add($0, $1) } into %buf1
    }
"""

from __future__ import annotations

from ...dsl.expr import Node
from ...dsl.ir import Module, Op, Role, TileType, Value
from .ir_util import move, replace_in, retyped


def vector_accumulators(module: Module) -> Module:
    vector_written = {op.attrs["into"].id for op in module.walk()
                      if op.name == "map" and op.attrs.get("into") is not None}
    targets = {}
    for op in module.walk():
        if op.name == "gemm":
            acc = op.args[2]
            if acc.type.role is not Role.ACCUMULATOR or acc.id in vector_written:
                targets[acc.id] = acc
    if not targets:
        return module
    for acc in targets.values():
        retyped(acc, Role.VECTOR)

    def rewrite(op: Op) -> list[Op]:
        if op.name != "gemm" or op.args[2].id not in targets:
            return [op]
        a, b, acc = op.args
        t = acc.type
        fresh = Value(TileType(t.shape, t.dtype, Role.ACCUMULATOR), mutable=True, hint="acc")
        alloc = Op("alloc", (), {"fill": 0.0}, fresh, [], op.loc)
        gemm = Op("gemm", (a, b, fresh), dict(op.attrs), None, [], op.loc)
        mv = move(fresh, Role.VECTOR, op.loc)
        expr = Node("add", t.shape, t.dtype, (Node("arg", t.shape, t.dtype, (), 0),
                                              Node("arg", t.shape, t.dtype, (), 1)))
        add = Op("map", (acc, mv.result), {"expr": expr, "into": acc}, None, [], op.loc)
        return [alloc, gemm, mv, add]

    replace_in(module.body, rewrite)
    return module
