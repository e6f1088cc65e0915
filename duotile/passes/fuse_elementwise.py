"""fuse_elementwise: turn chains of elementwise ops into single ``map`` ops.

Every ``ew`` / ``cast`` / ``iota`` / ``expand`` whose result is used once, by another such op
in the same block, with no write to a buffer it reads in between, is inlined into its user.
What remains becomes ``map`` ops with an expression tree; ``assign(buf, x)`` becomes
``map ... into buf``, so a generator sees one loop per map.

Before::

    %v20 = ew.sub(%buf2, %v17) -> f32[128x1]
    %v21 = ew.exp2(%v20) -> f32[128x1]
    %v22 = ew.mul(%buf3, %v21) -> f32[128x1]
    %v24 = ew.add(%v22, %v23) -> f32[128x1]
    assign(%buf3, %v24)

After (``%v21`` has two users, so it stays a value of its own)::

    %v21 = map(%buf2, %v17) { exp2(sub($0, $1)) } -> f32[128x1] vector
    map(%buf3, %v21, %v23) { add(mul($0, $1), $2) } into %buf3
"""

from __future__ import annotations

from collections import Counter

from ..dsl.dtypes import f32, i32
from ..dsl.expr import Node
from ..dsl.ir import Block, Module, Op, Value

FUSIBLE = ("ew", "cast", "iota", "expand")


def fuse_elementwise(module: Module) -> Module:
    uses = Counter(v.id for op in module.walk() for v in _reads(op))
    index_only = _index_only_ops(module)
    _fuse_block(module.body, uses, index_only)
    return module


def _index_only_ops(module: Module) -> dict[int, Op]:
    """Ops computing from loop indices alone (iota, index math): cheap, so recomputed at every
    elementwise use. One that another kind of op reads (a gather's index tile) is not listed: it
    stays a value of its own."""
    found: dict[int, Op] = {}
    for op in module.walk():  # definitions come before uses in a walk
        if op.name in FUSIBLE and op.result is not None and all(v.id in found for v in op.values()):
            found[op.result.id] = op
    read_elsewhere = {v.id for op in module.walk() if op.name not in (*FUSIBLE, "assign") for v in _reads(op)}
    return {k: op for k, op in found.items() if k not in read_elsewhere}


def _reads(op: Op):
    yield from op.values()
    if op.attrs.get("into") is not None:
        yield op.attrs["into"]


class _Fuser:
    def __init__(self, block: Block, uses: Counter, index_only: dict[int, Op]):
        self.ops = block.ops
        self.uses = uses
        self.index_only = index_only
        self.pos = {op.result.id: i for i, op in enumerate(self.ops) if op.result is not None}
        self.inlined: set[int] = set()
        self.writers: dict[int, list[int]] = {}  # buffer id -> positions of the ops writing it, ascending
        for i, op in enumerate(self.ops):
            for b in op.written_ids():
                self.writers.setdefault(b, []).append(i)
        self.leaves: dict[int, set[int]] = {}  # position -> ids of the values its inlined tree reads

    def inlinable(self, v: Value, user_pos: int) -> bool:
        """Whether ``v`` is one elementwise use away from its user at ``user_pos``, with no op in
        between writing a value its tree reads."""
        i = self.pos.get(v.id)
        if i is None or self.ops[i].name not in FUSIBLE or self.uses[v.id] != 1:
            return False
        return not any(i < j < user_pos for b in self.leaf_ids(i) for j in self.writers.get(b, ()))

    def leaf_ids(self, i: int) -> set[int]:
        """Ids of the values the op at ``i`` reads once its single-use elementwise inputs are inlined."""
        if i not in self.leaves:
            ids = set()
            for a in self.ops[i].values():
                j = self.pos.get(a.id)
                if j is not None and self.ops[j].name in FUSIBLE and self.uses[a.id] == 1:
                    ids |= self.leaf_ids(j)
                else:
                    ids.add(a.id)
            self.leaves[i] = ids
        return self.leaves[i]

    def tree(self, op: Op, user_pos: int, inputs: list[Value]) -> Node:
        t = op.result.type
        if op.name == "iota":
            return Node("iota", t.shape, t.dtype, (), op.attrs["axis"])
        children = tuple(self.leaf(a, user_pos, inputs) for a in op.args)
        if op.name == "cast":
            return Node("cast", t.shape, t.dtype, children, op.attrs["dtype"])
        if op.name == "expand":
            return Node("expand", t.shape, t.dtype, children, op.attrs["axis"])
        if op.attrs["fn"] == "splat":
            return children[0]
        return Node(op.attrs["fn"], t.shape, t.dtype, children)

    def leaf(self, a, user_pos: int, inputs: list[Value]) -> Node:
        if not isinstance(a, Value):
            is_int = getattr(a, "is_Integer", False) or (hasattr(a, "free_symbols") and a.free_symbols)
            kind = "scalar" if hasattr(a, "free_symbols") and a.free_symbols else "const"
            value = a if kind == "scalar" else (int(a) if is_int else float(a))
            return Node(kind, (), i32 if is_int else f32, (), value)
        if a.id in self.index_only:
            return self.tree(self.index_only[a.id], user_pos, inputs)
        if self.inlinable(a, user_pos):
            self.inlined.add(a.id)
            return self.tree(self.ops[self.pos[a.id]], user_pos, inputs)
        if a not in inputs:
            inputs.append(a)
        return Node("arg", a.type.shape, a.type.dtype, (), inputs.index(a))

    def run(self) -> list[Op]:
        out: list[Op] = []
        for i in reversed(range(len(self.ops))):  # users first, so inlining is decided top-down
            op = self.ops[i]
            if op.result is not None and (op.result.id in self.inlined or op.result.id in self.index_only):
                continue
            if op.name in FUSIBLE:
                inputs: list[Value] = []
                expr = self.tree(op, i, inputs)
                op = Op("map", tuple(inputs), {"expr": expr, "into": None}, op.result, [], op.loc)
            elif op.name == "assign":
                op = self.assign_to_map(op, i)
            out.append(op)
        return out[::-1]

    def assign_to_map(self, op: Op, i: int) -> Op:
        dst, src = op.args
        inputs: list[Value] = []
        expr = self.leaf(src, i, inputs)
        return Op("map", tuple(inputs), {"expr": expr, "into": dst}, None, [], op.loc)


def _fuse_block(block: Block, uses: Counter, index_only: dict[int, Op]):
    for op in block.ops:
        for region in op.regions:
            _fuse_block(region, uses, index_only)
    block.ops = _Fuser(block, uses, index_only).run()
