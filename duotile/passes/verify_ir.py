"""verify_ir: check the structural rules every later stage relies on.

It changes nothing. It raises DslError, naming the op's source line, when:
- a value is used before it is defined, or outside the region that defines it;
- a non-buffer is written (``assign`` / ``gemm`` accumulator);
- a top-level op is not a ``grid`` (a module holds one grid per phase), or a loop sits outside one;
- a phase reads a workspace that no earlier phase writes;
- a tile dimension is not a positive integer (only checked once ``shapes`` are bound);
- an index expression uses a symbol that is neither a loop variable, a size nor a scalar read from
  data (``dsl.scalar``) before it; or a grid's or loop's bounds use such a scalar;
- a bit operation (``& | ^ << >>`` on integers, ``bitcast``) breaks its type rule: bitwise
  operands are integer (not boolean) tiles, a shift count is a constant in ``[0, bits)``, a
  bitcast joins two types of one width (``f32 <-> i32``); checked on ``ew`` ops and inside the
  expression trees of fused ``map`` ops alike;
- an ``mxfp4`` op's operands are not u8 (R, C) packed codes and u8 (R, 2C / 32) scale codes, or its
  result not the bf16 (R, 2C) values; an ``mxfp8`` op's are not e4m3 (R, C) values and u8 (R, G)
  scale codes with G dividing C, or its result not the bf16 (R, C) values; a ``cumsum`` op's
  operand or result is not i32.
"""

from __future__ import annotations

from ..dsl import dtypes
from ..dsl.errors import DslError
from ..dsl.expr import Node
from ..dsl.ir import Block, Module, Op, Value
from ..dsl.ops import BITCASTS, BITWISE, MXFP4_BLOCK, NVFP4_BLOCK, SHIFTS

STORES = ("store", "scatter")  # the ops that write a tensor (a scatter: rows named by an index tile)


def verify_ir(module: Module) -> Module:
    body = module.body.ops
    if not body or any(op.name != "grid" for op in body):
        raise DslError(f"{module.name}: the module body must be grid ops only (one per phase)")
    sizes = {s for p in module.params for d in p.shape for s in d.free_symbols}
    _check_block(module.body, module, set(), set(sizes), bound=bool(module.shapes))
    if module.phase is None:  # a phase split off a kernel reads what the phases before it wrote
        _check_workspaces(module)
    return module


def _check_workspaces(module: Module):
    """A workspace is uninitialised at each call: a phase may read one only after an earlier
    phase has written it (within one phase, blocks run in no order)."""
    scratch = {p.name for p in module.workspaces}
    written: set[str] = set()
    for grid in module.body.ops:
        ops = [op for op in grid.walk() if op.attrs.get("tensor") in scratch]
        for op in ops:
            if op.name not in STORES and op.attrs["tensor"] not in written:
                raise DslError(f"a phase reads workspace {op.attrs['tensor']!r} before an earlier phase "
                               "writes it", op.loc)
        written |= {op.attrs["tensor"] for op in ops if op.name in STORES}


def _check_block(block: Block, module: Module, visible: set[int], symbols: set, bound: bool):
    visible, symbols = set(visible), set(symbols)
    for op in block.ops:
        for v in op.values():
            if v.id not in visible:
                raise DslError(f"{op.name} uses {v!r} before (or outside) its definition", op.loc)
        _check_writes(op)
        _check_symbols(op, symbols)
        _check_bit_ops(op)
        if op.name in SCALED_VALUES:
            _check_scaled_values(op, bound)
        if op.name == "gemm" and bound:
            _check_gemm_dims(op)
        if op.name == "cumsum" and not (op.args[0].type.dtype == op.result.type.dtype == dtypes.i32):
            raise DslError(f"cumsum sums i32 tiles, got {op.args[0].type.dtype} -> {op.result.type.dtype}", op.loc)
        if op.result is not None:
            _check_dims(op, bound)
            visible.add(op.result.id)
        if op.name == "scalar":  # an index symbol read from data, from here to the block's end
            symbols.add(op.attrs["var"])
        if op.name in ("grid", "for"):
            _check_bounds_are_sizes(op, module)
            if op.name == "grid" and block is not module.body:
                raise DslError("grid must be the outermost op", op.loc)
            inner = set(op.attrs["vars"]) if op.name == "grid" else {op.attrs["var"]}
            _check_block(op.regions[0], module, visible, symbols | inner, bound)
        elif op.regions:
            raise DslError(f"{op.name} cannot have a body", op.loc)


def _check_bounds_are_sizes(op: Op, module: Module):
    """A grid's or loop's bounds are sizes, tunables and loop variables: passes and capacity checks
    count their trips, which a symbol read from data (``dsl.scalar``) would leave unknown."""
    data = {o.attrs["var"] for o in module.walk() if o.name == "scalar"}
    bounds = [*op.attrs.get("extents", []), op.attrs.get("extent"), op.attrs.get("start")]
    used = set().union(*(b.free_symbols for b in bounds if hasattr(b, "free_symbols"))) & data
    if used:
        raise DslError(f"{op.name} bounds use {', '.join(sorted(map(str, used)))}, read from data by dsl.scalar: "
                       "a bound is a size, a tunable or a loop variable (a loop's end read from data is stop=)",
                       op.loc)


def _check_writes(op: Op):
    target = {"assign": 0, "gemm": 2}.get(op.name)
    if target is not None and not op.args[target].mutable:
        raise DslError(f"{op.name} writes {op.args[target]!r}, which is not a buffer", op.loc)
    if op.name == "map" and op.attrs.get("into") is not None and not op.attrs["into"].mutable:
        raise DslError(f"map writes into {op.attrs['into']!r}, which is not a buffer", op.loc)


def _exprs(op: Op):
    for key in ("offsets", "extent", "extents", "start", "first"):
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


# the block-scaled value ops: the first operand's dtype and name, and the shape rule over
# (values or packed (R, C), codes (R, G), result (R', C')) with its text
SCALED_VALUES = {
    "mxfp4": (dtypes.u8, "u8 packed codes",
              lambda r, c, rc, g, ro, co: r == rc == ro and co == 2 * c and co % MXFP4_BLOCK == 0
              and g == co // MXFP4_BLOCK, f"(R, C), (R, 2C / {MXFP4_BLOCK}) -> (R, 2C)"),
    "mxfp8": (dtypes.f8e4m3, "e4m3 values",
              lambda r, c, rc, g, ro, co: r == rc == ro and c == co and g > 0 and c % g == 0,
              "(R, C), (R, G) -> (R, C) with G dividing C"),
    "nvfp4": (dtypes.u8, "u8 packed codes",
              lambda r, c, rc, g, ro, co: r == rc == ro and co == 2 * c and co % NVFP4_BLOCK == 0
              and g == co // NVFP4_BLOCK, f"(R, C), (R, 2C / {NVFP4_BLOCK}) -> (R, 2C)"),
}
# the scales' dtype and name: UE8M0 codes, or (NVFP4) E4M3 scales
SCALE_DTYPES = {"mxfp4": (dtypes.u8, "u8 scale codes"), "mxfp8": (dtypes.u8, "u8 scale codes"),
                "nvfp4": (dtypes.f8e4m3, "e4m3 scales")}


def _check_gemm_dims(op: Op):
    """The inner dimensions agree once the sizes are bound (the spec line checks them where they
    are numbers or the same symbol: a row of ``D`` channels against ``2 DH`` packed ones is
    known only here)."""
    a, b, acc = (v.type.shape for v in op.args[:3])
    m, ka = (a[1], a[0]) if op.attrs["transpose_a"] else a
    kb, n = (b[1], b[0]) if op.attrs["transpose_b"] else b
    if ka != kb:
        raise DslError(f"gemm inner dimensions differ: a gives K={ka}, b gives K={kb}", op.loc)
    if tuple(acc) != (m, n):
        raise DslError(f"gemm accumulator has shape {tuple(acc)}, expected ({m}, {n})", op.loc)


def _check_scaled_values(op: Op, bound: bool):
    first_dtype, first, fits, rule = SCALED_VALUES[op.name]
    x, codes = (a.type for a in op.args)
    out = op.result.type
    scale_dtype, scale_name = SCALE_DTYPES[op.name]
    if x.dtype != first_dtype or codes.dtype != scale_dtype or out.dtype != dtypes.bf16:
        raise DslError(f"{op.name} takes {first} and {scale_name} to bf16, got {x.dtype}, "
                       f"{codes.dtype} -> {out.dtype}", op.loc)
    if not bound:
        return
    (r, c), (rc, g), (ro, co) = ((int(d) for d in t.shape) for t in (x, codes, out))
    count, first = int(op.attrs["count"]), op.attrs["first"]
    if not fits(r, c, rc, count, ro, co):
        raise DslError(f"{op.name} shapes {x.shape}, {codes.shape} -> {out.shape} (reading {count} codes a row) "
                       f"are not {rule}", op.loc)
    if g < count or (first.is_Integer and not 0 <= int(first) <= g - count):
        raise DslError(f"{op.name} reads {count} codes a row from column {first} of a {g}-column codes tile", op.loc)


def _check_bit_ops(op: Op):
    if op.name == "ew" and (op.attrs["fn"] in BITWISE or op.attrs["fn"] == "bitcast"):
        kids = [(a.type.dtype, None) if isinstance(a, Value) else (None, a) for a in op.args]
        _check_bit_rule(op.attrs["fn"], op.result.type.dtype, kids, op)
    elif op.name == "map":
        for node in _nodes(op.attrs["expr"]):
            if node.kind in BITWISE or node.kind == "bitcast":
                kids = [(None, c.attr) if c.kind == "const" else (c.dtype, None) for c in node.children]
                _check_bit_rule(node.kind, node.dtype, kids, op)


def _nodes(node: Node):
    yield node
    for c in node.children:
        yield from _nodes(c)


def _check_bit_rule(fn: str, result, kids: list, op: Op):
    """``kids``: (dtype, None) for a tile operand, (None, value) for an immediate."""
    if fn == "bitcast":
        src = kids[0][0]
        if src is None or (src.name, result.name) not in BITCASTS:
            raise DslError(f"bitcast from {src} to {result}: only {sorted(BITCASTS)} reinterpret bits", op.loc)
        return
    if result.is_float or result == dtypes.bool_ or any(d is not None and (d.is_float or d == dtypes.bool_)
                                                        for d, _ in kids):
        raise DslError(f"{fn} needs integer operands and result, got {[d for d, _ in kids]} -> {result}", op.loc)
    if fn in SHIFTS:
        count = kids[1][1]
        if count is None or isinstance(count, float) or not hasattr(count, "__int__") \
                or not 0 <= int(count) < result.bits:
            raise DslError(f"{fn} needs a constant count in [0, {result.bits}), got "
                           f"{kids[1][0] or count}", op.loc)
