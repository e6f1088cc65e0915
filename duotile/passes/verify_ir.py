"""verify_ir: check the structural rules every later stage relies on.

It changes nothing. It raises DslError, naming the op's source line, when:
- a value is used before it is defined, or outside the region that defines it;
- a non-buffer is written (``assign`` / ``gemm`` accumulator);
- ``grid`` is not the single top-level op, or a loop sits outside it;
- a tile dimension is not a positive integer (only checked once ``shapes`` are bound);
- an index expression uses a symbol that is neither a loop variable nor a size.
"""

from __future__ import annotations

from ..dsl.errors import DslError
from ..dsl.ir import Block, Module, Op


def verify_ir(module: Module) -> Module:
    body = module.body.ops
    if len(body) != 1 or body[0].name != "grid":
        raise DslError(f"{module.name}: the module body must be exactly one grid op")
    sizes = {s for p in module.params for d in p.shape for s in d.free_symbols}
    _check_block(module.body, module, set(), set(sizes), bound=bool(module.shapes))
    return module


def _check_block(block: Block, module: Module, visible: set[int], symbols: set, bound: bool):
    visible = set(visible)
    for op in block.ops:
        for v in op.values():
            if v.id not in visible:
                raise DslError(f"{op.name} uses {v!r} before (or outside) its definition", op.loc)
        _check_writes(op)
        _check_symbols(op, symbols)
        if op.result is not None:
            _check_dims(op, bound)
            visible.add(op.result.id)
        if op.name in ("grid", "for"):
            if op.name == "grid" and block is not module.body:
                raise DslError("grid must be the outermost op", op.loc)
            inner = set(op.attrs["vars"]) if op.name == "grid" else {op.attrs["var"]}
            _check_block(op.regions[0], module, visible, symbols | inner, bound)
        elif op.regions:
            raise DslError(f"{op.name} cannot have a body", op.loc)


def _check_writes(op: Op):
    target = {"assign": 0, "gemm": 2}.get(op.name)
    if target is not None and not op.args[target].mutable:
        raise DslError(f"{op.name} writes {op.args[target]!r}, which is not a buffer", op.loc)
    if op.name == "map" and op.attrs.get("into") is not None and not op.attrs["into"].mutable:
        raise DslError(f"map writes into {op.attrs['into']!r}, which is not a buffer", op.loc)


def _exprs(op: Op):
    for key in ("offsets", "extent", "extents", "start"):
        val = op.attrs.get(key)
        if val is None:
            continue
        yield from (val if isinstance(val, (list, tuple)) else [val])
    for a in op.args:
        if hasattr(a, "free_symbols"):
            yield a


def _check_symbols(op: Op, symbols: set):
    for e in _exprs(op):
        unknown = e.free_symbols - symbols
        if unknown:
            names = ", ".join(sorted(map(str, unknown)))
            raise DslError(f"{op.name} uses {names} outside the loops that define them", op.loc)


def _check_dims(op: Op, bound: bool):
    for d in op.result.type.shape:
        if bound and not (d.is_Integer and int(d) > 0):
            raise DslError(f"{op.name} produces a tile with dimension {d}, not a positive int", op.loc)
