"""Small helpers the Ascend passes share: building ops, finding uses, rewriting blocks."""

from __future__ import annotations

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Block, Module, Op, Role, TileType, Value

TARGET = "ascend950"


def unsupported(what: str, op: Op) -> UnsupportedError:
    return UnsupportedError(f"{TARGET}: {what} (op {op.name})", op.loc)


def reads(op: Op) -> list[Value]:
    out = list(op.values())
    into = op.attrs.get("into")
    if isinstance(into, Value):
        out.append(into)
    return out


def writes(op: Op) -> Value | None:
    return next(iter(op.writes()), None)


def retyped(v: Value, role: Role) -> None:
    """Give ``v`` another role in place (its users keep pointing at the same Value)."""
    v.type = TileType(v.type.shape, v.type.dtype, role)


def move(v: Value, role: Role, loc) -> Op:
    """``%r = move(%v) -> <role>``: copy a tile to the memory of another role."""
    result = Value(TileType(v.type.shape, v.type.dtype, role), hint=f"{v.hint or 'v'}_{role.value[:3]}")
    return Op("move", (v,), {}, result, [], loc)


def blocks(module: Module):
    """Every block of the module, outermost first."""
    stack = [module.body]
    while stack:
        b = stack.pop()
        yield b
        for op in b.ops:
            stack.extend(op.regions)


def defining_ops(module: Module) -> dict[int, Op]:
    return {op.result.id: op for op in module.walk() if op.result is not None}


def replace_in(block: Block, fn) -> None:
    """Rebuild ``block.ops`` with ``fn(op) -> list[Op]`` (recursing into regions first)."""
    new = []
    for op in block.ops:
        for r in op.regions:
            replace_in(r, fn)
        new.extend(fn(op))
    block.ops = new
