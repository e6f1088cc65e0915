"""insert_moves: make every cross-unit transfer an explicit ``move`` op, so that the memory
check counts its buffer and the generator lowers it to one copy:

- vector work (map, reduce) reading an accumulator: L0C -> UB (``move ... -> vector``);
- a gemm operand computed by vector work: UB -> L1 (``move ... -> operand``).

Before (gemm epilogue)::

    %v3 = map(%buf0) { bf16($0) } -> bf16[128x128] vector

After::

    %buf0_vec4 = move(%buf0) -> f32[128x128] vector
    %v3 = map(%buf0_vec4) { bf16($0) } -> bf16[128x128] vector

Vector work reading an operand (L1) tile has no path on Ascend and raises UnsupportedError.
"""

from __future__ import annotations

from ...dsl.ir import Module, Op, Role
from .ir_util import move, replace_in, unsupported

VECTOR_OPS = ("map", "reduce", "gather")


def insert_moves(module: Module) -> Module:
    def rewrite(op: Op) -> list[Op]:
        pre: list[Op] = []
        if op.name in VECTOR_OPS:
            args = list(op.args)
            for i, a in enumerate(args):
                role = getattr(getattr(a, "type", None), "role", None)
                if role is Role.ACCUMULATOR:
                    mv = move(a, Role.VECTOR, op.loc)
                    pre.append(mv)
                    args[i] = mv.result
                elif role is Role.OPERAND:
                    raise unsupported(f"vector work reads {a!r}, an operand (L1) tile; load it with "
                                      "role='vector' as well", op)
            op.args = tuple(args)
        elif op.name == "gemm":
            args = list(op.args)
            for i in (0, 1):
                if args[i].type.role is Role.VECTOR:
                    mv = move(args[i], Role.OPERAND, op.loc)
                    pre.append(mv)
                    args[i] = mv.result
            op.args = tuple(args)
        return pre + [op]

    replace_in(module.body, rewrite)
    return module
