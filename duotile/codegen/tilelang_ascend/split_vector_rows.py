"""split_vector_rows (knob ``vector_split``): each of a cube core's two vector cores (AIVs)
works on half the rows of the vector tiles, instead of both doing the whole tile.

An Ascend 950 AI core pairs one cube with two AIVs (the ``__mix__(1, 2)`` kernel). Without the
split both AIVs run the same vector code on the same tile: correct, but the second one only
repeats the first. With it, ``T.dual_copy`` moves the rows of a cube result apart (L0C -> UB,
hardware dual destination, M-split) and back (UB -> L1), and loads and stores of the split tiles
become per-AIV copies of their half. Every UB buffer of a split tile is half as tall, so the
vector side also needs half the UB.

Which values split: the tiles moved out of L0C, then every vector value whose first dimension
is the same rows -- the results of maps and row reductions over them, the buffers they are
written into, and the tiles they are combined with row by row (a per-row scale loaded from GM,
say). Found by walking each map's expression tree: an argument read at the output's row index
is split along with it; one broadcast over the rows is not.

Refused (UnsupportedError, with the op's line): a kernel with no gemm (``dual_copy`` needs cube
work in the kernel), a reduction over the rows, a split row read at another position (a
transpose), a row index used as a value (``arange`` over the rows: an AIV does not know which
half it has in TileLang's auto-scheduled kernels), gathers of split tiles, odd row counts.

Before (attention, one iteration; BM = 64)::

    %s_vec = move(%s) -> f32[64x128] vector
    %m = reduce max(%s_vec, axis=1) -> f32[64] vector

After::

    %s_vec = move(%s) -> f32[32x128] vector   {dual}
    %m = reduce max(%s_vec, axis=1) -> f32[32] vector
"""

from __future__ import annotations

import sympy

from ...dsl.expr import Node, child_index
from ...dsl.ir import Module, Op, Role, TileType, Value
from .ir_util import unsupported

ROW = "row"


def split_vector_rows(module: Module) -> Module:
    ops = list(module.walk())
    if not any(op.name == "gemm" for op in ops):
        raise unsupported("vector_split needs a kernel with cube work (a gemm): dual_copy splits a cube "
                          "result between the two vector cores", module.grid)
    split = {op.result.id: op.result for op in ops
             if op.name == "move" and op.args[0].type.role is Role.ACCUMULATOR}
    rows = {id(op): _arg_rows(op) for op in ops if op.name == "map"}  # per argument, once
    changed = True
    while changed:
        changed = False
        for op in ops:
            for v in _spreads(op, split, rows):
                if v.id not in split:
                    split[v.id] = v
                    changed = True
    for op in ops:
        _check(op, split, rows)
    for v in split.values():
        rows = int(v.type.shape[0])
        if rows % 2 or rows < 4:
            raise unsupported(f"vector_split halves the rows of {v!r}; {rows} rows cannot be split", _def(ops, v))
        v.type = TileType((sympy.Integer(rows // 2), *v.type.shape[1:]), v.type.dtype, v.type.role)
    for op in ops:
        if op.name in ("move", "load", "store") and any(v.id in split for v in _touched(op)):
            if op.attrs.get("transpose"):
                raise unsupported("vector_split: a transposed load of a split tile", op)
            op.attrs["dual"] = True
    return module


def _touched(op: Op) -> list[Value]:
    return [*op.values(), *([op.result] if op.result is not None else [])]


def _def(ops: list[Op], v: Value) -> Op:
    return next((op for op in ops if op.result is v), ops[0])


def _spreads(op: Op, split: dict[int, Value], rows: dict) -> list[Value]:
    """Values that must be split because ``op`` ties their rows to a split value's rows."""
    if op.name == "map":
        out = op.attrs.get("into") or op.result
        row_args = [a for a, seen in zip(op.args, rows[id(op)]) if seen == "rows"]
        tied = [out, *row_args] + ([op.result] if op.result is not None and op.result is not out else [])
        return tied if any(v.id in split for v in tied) else []
    if op.name == "reduce" and op.attrs["axis"] != 0:
        tied = [op.args[0], op.result]
        return tied if any(v.id in split for v in tied) else []
    return []


def _check(op: Op, split: dict[int, Value], rows: dict) -> None:
    if op.name == "map":
        out = op.attrs.get("into") or op.result
        for a, seen in zip(op.args, rows[id(op)]):
            if a.id in split and seen not in ("rows",):
                raise unsupported(f"vector_split: {a!r} is split by rows but read here {seen}", op)
        if out.id in split and _row_iota(op):
            raise unsupported("vector_split: a row index used as a value (an arange over the rows); an AIV "
                              "does not know which half of the rows it holds", op)
    elif op.name == "reduce" and op.args[0].id in split and op.attrs["axis"] == 0:
        raise unsupported("vector_split: a reduction over the split rows (each AIV holds half of them)", op)
    elif op.name == "gather" and any(v.id in split for v in _touched(op)):
        raise unsupported("vector_split: a gather into or from a split tile", op)


def _indices(op: Op) -> dict:
    """Argument number (or "iota") -> the index tuples it is read at, for an element of the
    map's output at (ROW, c1, c2, ...)."""
    out = op.attrs.get("into") or op.result
    seen: dict = {}
    _walk(op.attrs["expr"], tuple([ROW] + [f"c{d}" for d in range(1, len(out.type.shape))]), seen)
    return seen


def _row_iota(op: Op) -> bool:
    return any(i == ROW for i in _indices(op).get("iota", ()))


def _arg_rows(op: Op) -> list[str]:
    """For each argument of a map: "rows" when it is read at the output's row index, "broadcast"
    when it is read the same for every row, else where the row index lands in it."""
    seen = _indices(op)
    verdicts = []
    for k, _ in enumerate(op.args):
        idx = seen.get(k, set())
        if not idx or all(ROW not in i for i in idx):
            verdicts.append("broadcast")
        elif all(len(i) and i[0] == ROW for i in idx):
            verdicts.append("rows")
        else:
            verdicts.append("at another position (a transpose)")
    return verdicts


def _walk(node: Node, idx: tuple, seen: dict[int, set]) -> None:
    if node.kind == "arg":
        seen.setdefault(node.attr, set()).add(idx)
        return
    if node.kind == "iota":
        seen.setdefault("iota", set()).add(idx[node.attr])
        return
    if node.kind in ("const", "scalar"):
        return
    for c in node.children:
        if c.kind in ("const", "scalar"):
            continue
        _walk(c, child_index(node, c, idx), seen)
