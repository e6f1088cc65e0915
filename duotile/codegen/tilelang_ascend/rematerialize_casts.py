"""rematerialize_casts: a map that only converts one immutable tile (``f32($0)``) and feeds
other maps is recomputed inside each of them instead of being kept as a UB buffer. UB is the
scarce memory on Ascend (216 KiB with SIMT regions) and a cast is one vector instruction.

Before (rmsnorm, D=16384: %v1 costs 64 KiB of UB)::

    %x0 = load x[t, 0] -> bf16[1x16384] vector
    %v1 = map(%x0) { f32($0) } -> f32[1x16384] vector
    %v2 = map(%v1) { mul($0, $0) } -> f32[1x16384] vector
    %v13 = map(%v1, %v3, %w5) { bf16(mul(mul($0, ...), ...)) } -> bf16[1x16384] vector

After::

    %x0 = load x[t, 0] -> bf16[1x16384] vector
    %v2 = map(%x0) { mul(f32($0), f32($0)) } -> f32[1x16384] vector
    %v13 = map(%x0, %v3, %w5) { bf16(mul(mul(f32($0), ...), ...)) } -> bf16[1x16384] vector
"""

from __future__ import annotations

from dataclasses import replace

from ...dsl.expr import Node
from ...dsl.ir import Block, Module, Op


def rematerialize_casts(module: Module) -> Module:
    users: dict[int, list[Op]] = {}
    for op in module.walk():
        for v in op.values():
            users.setdefault(v.id, []).append(op)
        into = op.attrs.get("into")
        if into is not None:
            users.setdefault(into.id, []).append(op)
    _block(module.body, users)
    return module


def _is_cast(op: Op) -> bool:
    e = op.attrs.get("expr")
    return (op.name == "map" and op.attrs.get("into") is None and len(op.args) == 1
            and not op.args[0].mutable and e is not None and e.kind == "cast"
            and e.children[0].kind == "arg")


def _block(block: Block, users: dict[int, list[Op]]) -> None:
    keep = []
    for op in block.ops:
        for r in op.regions:
            _block(r, users)
        uses = users.get(op.result.id, []) if op.result is not None else []
        if _is_cast(op) and uses and all(u.name == "map" and u.attrs.get("into") is not op.result
                                         and any(u is b for b in block.ops) for u in uses):
            for u in uses:
                _inline(u, op)
            continue
        keep.append(op)
    block.ops = keep


def _inline(user: Op, cast: Op) -> None:
    src = cast.args[0]
    args = list(user.args)
    if src not in args:
        args.append(src)
    k = args.index(src)
    old = user.args.index(cast.result)
    inner = Node("arg", src.type.shape, src.type.dtype, (), k)
    expr = cast.attrs["expr"]
    sub = replace(expr, children=(inner,))

    def walk(n: Node) -> Node:
        if n.kind == "arg" and n.attr == old:
            return replace(sub, shape=n.shape) if n.shape == sub.shape else sub
        return replace(n, children=tuple(walk(c) for c in n.children)) if n.children else n

    user.attrs["expr"] = walk(user.attrs["expr"])
    args[old] = src  # the old slot now also names src; drop it if unused
    user.args = tuple(args)
    _compact(user)


def _compact(op: Op) -> None:
    used = sorted({leaf.attr for leaf in op.attrs["expr"].leaves() if leaf.kind == "arg"})
    remap = {old: new for new, old in enumerate(used)}

    def walk(n: Node) -> Node:
        if n.kind == "arg":
            return replace(n, attr=remap[n.attr])
        return replace(n, children=tuple(walk(c) for c in n.children)) if n.children else n

    op.attrs["expr"] = walk(op.attrs["expr"])
    op.args = tuple(op.args[i] for i in used)
