"""What the CUDA emitter decides before it writes a line: where each value lives.

Rules (each a target lowering rule any kernel can hit, never a kernel special case):
- a tile that feeds a gemm as ``b`` (or as ``a`` on TMEM arches) lives in shared memory;
  other loads with role ``operand`` too; ``vector`` tiles and map results are fragments. A
  gather is such a load: its rows are written straight into shared memory. (Gathered into
  registers and copied to shared memory before each gemm that read it, sparse decode's
  64 x 512 BF16 rows took 64 KB of registers beside a 64 x 512 FP32 accumulator: ptxas spilled
  21 KB a thread, and a decode call of 640 rows took 165 us on an H200.) The index tile of such
  a gather, where a load makes it, lives in shared memory too: as a register tile, TileLang laid
  the gather's loop out as the index tile's fragment, whose rows sit on threads replicated over
  the warp groups, and left the copy to the two threads that own the replicas (the ThreadSync
  warning about a hoisted barrier; sparse decode: 64 KB by 2 threads, about 20 us a 64-row
  block on an H200). A buffer holding copies of loaded index tiles (one read a step ahead by
  ``passes/prefetch_loads.py``) counts as loaded.
- ``dsl.mxfp4_values``' result lives in shared memory (its helper writes 16-byte runs of the
  layout a gemm reads), and so do the loaded tiles it reads (packed codes and scale codes): as
  (BN, 1)-shaped register tiles laid out on 128 threads, TileLang ran the expansion loop on one
  of two consumer warp groups (a hand-edited MoE main phase, 2026-12-04: docs/ffn_path.md).
  ``dsl.mxfp8_values`` likewise (its loop writes the operand a gemm reads; its codes are read at
  each column's block). Both stay FP8 in shared memory where a gemm of them takes the block-scaled
  MMA (``block_scaled.py``, sm100).
- an ``accumulator`` buffer is a fragment on sm90. On sm100 it lives in TMEM, drained through
  a fragment before vector work reads it, unless vector ops also write it (``map ... into``):
  then it stays a fragment and each gemm into it goes through a fresh TMEM tile that is added in.
- a gemm whose accumulator is reduced or rewritten by vector work gets the FullRow warp policy,
  so that each row lives within one warp group and row reductions stay in registers.
- sm90, where such an accumulator has too few rows for that (16 a warp: a 64-row tile over two
  warp groups) but whole wgmma tiles per group by columns: it is split by columns instead
  (FullCol; the column split). Row reductions then cross warp groups through a shared-memory
  workspace (TileLang's AllReduce), a fragment derived from it that feeds a gemm as ``a`` is
  staged through shared memory (its layout is not wgmma's A layout), and a map result that only
  a store reads is written straight to global memory instead of into a fragment: the column
  split is for accumulators too big for one warp group's registers (head dim 512).
- a zero-filled accumulator consumed first by a gemm is cleared by the gemm (``clear_accum``).
- a one-element tile loaded from global memory, or computed by maps from such tiles and from one-
  element reduction results alone, that only maps read, or gathers and scatters as their index, or a
  loop as its stop, or dsl.scalar (a per-sequence position broadcast into a mask, the row a gather or a scatter
  names, a row's RMS or a block's scale, an expert's K steps), is a thread-local value, which every
  thread loads or computes itself: TileLang 0.1.15 finds no fragment layout for a one-element
  fragment read inside parallel loops of other shapes. A reduction's result stays a fragment
  (TileLang reduces into one); every thread holds it after the all-reduce, so a thread-local map
  reads it at [0]. kv_insert's row (the ring slot a scatter names, the position a cos / sin gather
  reads, the row's rsqrt read by every channel block) failed so ("no available layout found").
- a reduction of a register tile of fewer elements than threads that do not divide the threads
  (a 1 x 7 row at 256 threads) is read from a shared-memory copy padded along the reduced axis
  with the reduction's identity (0, -inf, +inf) to a size that spreads evenly (``reduce_padding``):
  TileLang 0.1.15 lays such a tile out on 7 x 36 = 252 of the 256 threads, so its reduction
  covers 252, and where the result is read by all threads (broadcast back over the row) the
  lowering fails ("Inconsistent layouts between src and dst in ReduceOp"). At 256 threads a
  1 x N row summed and broadcast back fails for N = 3, 5, 6, 7, 12, 24, 31, 33, 48, 100 and 200,
  and lowers for N = 1, 2, 4, 8, 16, 32, 64, 128 and 256. On one or two warps (``threads`` 32 or
  64) a reduced axis that is not a power of two is padded to one whatever the tile's size:
  hc_pre's 4 x 24 tile at 32 threads otherwise lays each row on 24 threads, which TileLang's
  butterfly all-reduce refuses ("logical_width ... must be a power of two, got 24").
- reductions of tiles of different shapes whose results meet in elementwise work (read at the
  same indices by one map, directly or through maps and the buffers they write) are laid out anew
  (``relayout``): each is reduced into a fragment of its own, copied to shared memory and read
  back into the fragment the rest of the kernel reads, whose layout TileLang is then free to
  choose. TileLang 0.1.15 gives a reduction's result the layout its source implies (the rows of a
  64 x 64 tile on 64 threads each, those of a 64 x 1 tile on 4) and cannot give one fragment two
  layouts: ``row_sum(a) + row_sum(b)`` for a 64 x 1 ``a`` and a 64 x 64 ``b`` at 256 threads fails
  ("no available layout found"), as did moe_permute's positions at K = 1 (each slot's match, a
  64 x 1 sum, plus the earlier tokens' matches, a 64 x 64 lower-triangular sum). Reductions of one
  shape and axis (attention's row max and row sum of the scores) share their layout and are left
  alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...dsl.ir import Module, Op, Role, Value
from .arch import WARP_GROUP, Arch
from .block_scaled import find_block_scaled, raw_values
from .exprs import index


@dataclass
class Plan:
    scope: dict[int, str] = field(default_factory=dict)  # value id -> shared | fragment | tmem | local
    mutated: set[int] = field(default_factory=set)  # accumulators that vector ops write
    full_row: set[int] = field(default_factory=set)  # accumulators needing FullRow
    clear_by_gemm: dict[int, str] = field(default_factory=dict)  # gemm op id -> clear_accum expr
    skip_fill: dict[int, str] = field(default_factory=dict)  # alloc id -> 'same' | 'loop': a gemm clears it
    staged: set[int] = field(default_factory=set)  # fragment values copied to shared for a gemm
    col_split: set[int] = field(default_factory=set)  # accumulators split by columns (FullCol)
    store_direct: set[int] = field(default_factory=set)  # map results written by their store, no fragment
    reduce_pad: dict[int, tuple[int, ...]] = field(default_factory=dict)  # reduce op id -> padded source shape
    relayout: set[int] = field(default_factory=set)  # reduce op ids whose result is laid out anew through shared
    block_scaled: dict = field(default_factory=dict)  # gemm op id -> BlockScaledGemm (block_scaled.py)
    raw: set[int] = field(default_factory=set)  # mxfp4 / mxfp8 results kept FP8 for a block-scaled gemm


def make_plan(module: Module, arch: Arch, threads: int | None = None, pipelined_gathers: bool = False) -> Plan:
    """``threads``: the consumer threads (the ``threads`` knob); the column split is decided with it.
    ``pipelined_gathers`` (the ``gather_pipeline`` knob): the loaded tiles a gather's index tile is
    computed from live in shared memory too, where a stage of the pipeline keeps a copy of each
    (``gather_pipeline.py``: a register tile read a stage later would have been overwritten)."""
    plan = Plan()
    ops = list(module.walk())
    sources: dict[int, set[int]] = {}  # value id -> the buffers it was computed from
    for op in ops:
        if op.result is not None:
            sources[op.result.id] = {op.result.id}.union(*(sources.get(a.id, {a.id}) for a in op.values()))
        if op.name == "map" and op.attrs.get("into") is not None:
            plan.mutated.add(op.attrs["into"].id)
        if op.name == "reduce":
            plan.full_row |= sources.get(op.args[0].id, set())
    plan.full_row |= plan.mutated
    if threads and not arch.has_tmem:
        _split_by_columns(ops, plan, threads // 32)
    gemm_b = {op.args[1].id for op in ops if op.name == "gemm"}
    gemm_a = {op.args[0].id for op in ops if op.name == "gemm"}
    if plan.col_split:  # fragments derived from a column-split accumulator come through shared memory
        gemm_a = {v for v in gemm_a if sources.get(v, {v}) & plan.col_split}
    local = _thread_local(ops)
    for op in ops:
        v = op.result
        if v is None:
            continue
        if v.id in local:
            plan.scope[v.id] = "local"
            continue
        plan.scope[v.id] = _scope(op, v, arch, plan, v.id in gemm_b, v.id in gemm_a)
        if op.name != "load" and plan.scope[v.id] == "fragment":
            if v.id in gemm_b or (v.id in gemm_a and (arch.has_tmem or plan.col_split)):
                plan.staged.add(v.id)
    _share_loaded_inputs(ops, plan)
    if pipelined_gathers:
        _share_index_sources(ops, plan, sources)
    plan.block_scaled = find_block_scaled(ops, arch, plan.scope)
    plan.raw = raw_values(plan.block_scaled)
    _find_gemm_clears(module, plan)
    if threads:
        for op in ops:
            if op.name == "reduce" and plan.scope.get(op.args[0].id) in ("fragment", "tmem"):
                padded = reduce_padding([int(d) for d in op.args[0].type.shape], op.attrs["axis"], threads)
                if padded is not None:
                    plan.reduce_pad[id(op)] = padded
    plan.relayout = _relayout(ops, plan)
    return plan


def _share_index_sources(ops: list[Op], plan: Plan, sources: dict[int, set[int]]) -> None:
    """The loaded register tiles a gather into shared memory computes its index tile from, moved
    to shared memory (``make_plan``'s ``pipelined_gathers``)."""
    loads = {op.result.id for op in ops if op.name == "load" and op.result is not None}
    for op in ops:
        if op.name == "gather" and plan.scope.get(op.result.id) == "shared":
            for v in sources.get(op.args[0].id, set()) & loads:
                if plan.scope.get(v) == "fragment":
                    plan.scope[v] = "shared"


def _share_loaded_inputs(ops: list[Op], plan: Plan) -> None:
    """The loaded tiles whose readers want them in shared memory (the module docstring): the index
    tile of a gather into shared memory (every thread of the gather's loop reads the rows it
    copies) and the inputs of an ``mxfp4`` / ``mxfp8`` op (a helper reads 4-byte words of them; a
    block-scaled MMA reads the values and the codes from shared memory). A buffer
    that holds copies of loaded tiles only (``prefetch_loads``: one read a step ahead) counts as
    loaded."""
    loaded = {op.result.id for op in ops if op.name == "load" and op.result is not None}
    writes: dict[int, list[bool]] = {}
    for op in ops:
        into = op.attrs.get("into") if op.name == "map" else None
        if into is not None:
            e = op.attrs["expr"]
            writes.setdefault(into.id, []).append(e.kind == "arg" and op.args[e.attr].id in loaded)
    loaded |= {v for v, copies in writes.items() if all(copies)}
    computed = {op.result.id for op in ops
                if op.name == "map" and op.result is not None and op.attrs.get("into") is None}
    for op in ops:
        if op.name == "gather" and plan.scope.get(op.result.id) == "shared":
            rows = op.args[0]
            if (rows.id in loaded or rows.id in computed) and plan.scope.get(rows.id) == "fragment":
                plan.scope[rows.id] = "shared"
        if op.name in ("mxfp4", "mxfp8", "nvfp4"):  # read as words (a helper), as a block-scaled MMA's operand
            for a in op.args:
                if a.id in loaded and plan.scope.get(a.id) == "fragment":
                    plan.scope[a.id] = "shared"


def spreads_evenly(n: int, threads: int) -> bool:
    """TileLang lays a register tile of ``n`` elements over every one of the threads."""
    return threads % n == 0 or n % threads == 0


def reduce_padding(shape: list[int], axis: int, threads: int) -> tuple[int, ...] | None:
    """The shape a reduction's source is padded to along ``axis`` (the module docstring), or None
    where the tile needs none: it has at least as many elements as threads (laid out evenly, or
    refused by ``capacity.check_fragment_layouts``) or its elements divide the threads."""
    n = math.prod(shape)
    if threads < WARP_GROUP and n >= threads and shape[axis] & (shape[axis] - 1):
        # one or two warps: a 4 x 24 tile at 32 threads is laid out with each row on 24 threads,
        # and TileLang's butterfly all-reduce needs a power of two ("logical_width ... got 24")
        return tuple(1 << (d - 1).bit_length() if i == axis else d for i, d in enumerate(shape))
    if n >= threads or spreads_evenly(n, threads):
        return None
    rest = n // shape[axis]
    extent = next(c for c in range(shape[axis], threads + 1) if spreads_evenly(rest * c, threads))
    return tuple(extent if i == axis else d for i, d in enumerate(shape))


def _one(v: Value) -> bool:
    return all(d == 1 for d in v.type.shape)


def _thread_local(ops: list[Op]) -> set[int]:
    """Ids of the one-element values every thread holds itself (the module docstring): made by a
    load, or by a map of such values and of one-element reduction results only, and read by maps,
    or by gathers and scatters as the index only."""
    made = {op.result.id: op for op in ops if op.result is not None and _one(op.result)
            and (op.name == "load" or (op.name == "map" and op.attrs.get("into") is None))}
    reduced = {op.result.id for op in ops if op.name == "reduce" and _one(op.result)}
    readers: dict[int, set[str]] = {}
    for op in ops:
        for k, a in enumerate(op.values()):
            index = (op.name == "gather" and k == 0) or (op.name == "scatter" and k == 1) \
                or op.name in ("for", "scalar")
            readers.setdefault(a.id, set()).add("index" if index else op.name)
        if op.attrs.get("into") is not None:
            readers.setdefault(op.attrs["into"].id, set()).add("into")
    local = {vid for vid in made if readers.get(vid, set()) <= {"map", "index"}}
    changed = True
    while changed:  # a map of a value that is neither local nor a reduction's result is not local
        changed = False
        for vid in list(local):
            if any(a.id not in local and a.id not in reduced for a in made[vid].values()):
                local.discard(vid)
                changed = True
    return local


def _relayout(ops: list[Op], plan: Plan) -> set[int]:
    """The reductions laid out anew (the module docstring): the fragments one map reads at its own
    indices (of its shape, or the buffer it writes) and the fragments a scatter reads at one index
    share a layout in TileLang; where such a set of fragments holds the results of reductions of
    different source shapes or axes, every one of those reductions is laid out anew."""
    parent: dict[int, int] = {}

    def find(v: int) -> int:
        while parent.setdefault(v, v) != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def frag(v: Value) -> bool:  # a register tile (a TMEM accumulator is read from the fragment it drains into)
        return plan.scope.get(v.id) in ("fragment", "tmem")

    for op in ops:
        if op.name == "map":
            out = op.attrs.get("into") or op.result
            if out is None or not frag(out):
                continue
            for a in op.values():
                if frag(a) and tuple(a.type.shape) == tuple(out.type.shape):
                    parent[find(a.id)] = find(out.id)
        elif op.name == "scatter":
            src, rows = op.args[:2]
            if frag(src) and frag(rows) and tuple(src.type.shape) == tuple(rows.type.shape):
                parent[find(src.id)] = find(rows.id)
    gemm_acc = {find(op.args[2].id) for op in ops if op.name == "gemm"}
    kinds: dict[int, set[tuple]] = {}  # a set's root -> the reductions' (source shape, axis, from a gemm)
    members: dict[int, list[int]] = {}
    for op in ops:
        if op.name == "reduce" and frag(op.result):
            src = op.args[0]
            root = find(op.result.id)
            shape = plan.reduce_pad.get(id(op), tuple(src.type.shape))  # a padded source is reduced
            kinds.setdefault(root, set()).add((shape, op.attrs["axis"], find(src.id) in gemm_acc))
            members.setdefault(root, []).append(id(op))
    return {r for root, ids in members.items() if len(kinds[root]) > 1 for r in ids}


def col_splittable(rows: int, cols: int, warps: int) -> bool:
    """A tile FullRow cannot lay out (16 rows a warp) that FullCol can: one m64 wgmma per warp
    group by rows, and a multiple of 8 columns per group."""
    groups = max(warps // 4, 1)
    return rows % (16 * warps) != 0 and rows % 64 == 0 and cols % (8 * groups) == 0


def _split_by_columns(ops: list[Op], plan: Plan, warps: int) -> None:
    for op in ops:
        if op.name == "gemm" and op.args[2].id in plan.full_row:
            rows, cols = (int(d) for d in op.args[2].type.shape[-2:])
            if col_splittable(rows, cols, warps):
                plan.col_split.add(op.args[2].id)
    if not plan.col_split:
        return
    uses: dict[int, int] = {}
    for op in ops:
        for a in op.values():
            uses[a.id] = uses.get(a.id, 0) + 1
    # a map result is never written again (only dsl.zeros / full / empty buffers are): read once,
    # by its store, it needs no fragment
    stored = {op.args[0].id for op in ops if op.name == "store"}
    plan.store_direct = {op.result.id for op in ops if op.name == "map" and op.result is not None
                         and op.attrs.get("into") is None and op.result.id in stored and uses[op.result.id] == 1}


def product_tile(acc: Value) -> str:
    """On a TMEM target, the name of the fresh TMEM tile a gemm into a register accumulator (one
    that vector work rewrites: an online softmax's output) multiplies into before it is added in:
    one a shape, shared by the accumulators of that shape, each gemm waiting for its product. So an
    output kept as column groups (a 64 x 512 output as eight 64 x 64 accumulators) takes one
    group's TMEM columns, not the whole width's."""
    return "prod_" + "x".join(str(int(d)) for d in acc.type.shape)


def _scope(op: Op, v: Value, arch: Arch, plan: Plan, feeds_b: bool, feeds_a: bool) -> str:
    role = v.type.role
    if op.name == "alloc" and role is Role.ACCUMULATOR:
        return "tmem" if arch.has_tmem and v.id not in plan.mutated else "fragment"
    if op.name in ("load", "gather") and (role is Role.OPERAND or feeds_b or (feeds_a and arch.has_tmem)):
        return "shared"
    if op.name in ("mxfp4", "mxfp8", "nvfp4"):  # written 16 bytes at a time by a helper (or by a loop), as a gemm reads
        return "shared"
    if op.name == "cumsum":  # written by its helper, a row in shared memory
        return "shared"
    return "fragment"


def _touches(op: Op, vid: int) -> bool:
    for o in [op, *(x for r in op.regions for x in r.walk())]:
        if any(a.id == vid for a in o.values()) or (o.attrs.get("into") is not None and o.attrs["into"].id == vid):
            return True
    return False


def _find_gemm_clears(module: Module, plan: Plan) -> None:
    """Zero-fill + first gemm -> ``clear_accum``; in the next loop -> ``clear_accum=(k == start)``."""
    for block in _blocks(module):
        for i, op in enumerate(block.ops):
            if op.name != "alloc" or op.attrs.get("fill") != 0.0 or op.result.type.role is not Role.ACCUMULATOR:
                continue
            vid = op.result.id
            nxt = next((o for o in block.ops[i + 1:] if _touches(o, vid)), None)
            if nxt is None:
                continue
            if nxt.name == "gemm" and nxt.args[2].id == vid:
                plan.clear_by_gemm[id(nxt)] = "True"
                plan.skip_fill[vid] = "same"
            elif nxt.name == "for":
                first = next((o for o in nxt.regions[0].ops if _touches(o, vid)), None)
                if first is not None and first.name == "gemm" and first.args[2].id == vid:
                    # the start as TIR text: sympy's own printing leaves `floor(...)`, which TileLang
                    # cannot read (a loop over one split range starts at floor(s * blocks / SPLIT))
                    plan.clear_by_gemm[id(first)] = f"{nxt.attrs['var']} == {index(nxt.attrs['start'])}"
                    plan.skip_fill[vid] = "loop"


def _blocks(module: Module):
    yield module.body
    for op in module.walk():
        yield from op.regions
