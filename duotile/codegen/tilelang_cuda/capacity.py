"""Static resource check for CUDA targets: shared memory per block, TMEM columns, registers per
thread, the register tiles TileLang can lay out over the threads, and on sm90 the warp layout of
row-split (FullRow) wgmma accumulators.

TileLang does not check shared memory (a 384 KiB kernel builds and fails only at launch), so
every config is checked here first. Shared bytes: each shared tile, times the pipeline depth
when it is loaded inside a pipelined loop (the tiles that live within one outermost loop counted
for the largest such loop alone: TileLang's merge of shared buffers by lifetime gives loops run
one after the other the same bytes, ``_loop_locals``), the padded copy of a small reduction's source
(``plan.reduce_padding``) and the copy a reduction laid out anew goes through (``plan.relayout``).
TMEM: fp32 accumulator columns, 512 per SM.
Registers: nothing stops a register tile of any size either (a 4096 x 4096 f32 tile built, with
256 KiB of stack a thread and minutes in ptxas), so the register tiles (fragments, and on sm100
the fragments TMEM is drained into) are summed, as if all were live at once, and divided by the
block's threads; above four times what a thread's 255 registers hold the config is refused. The
sum overstates what is live (ptxas reuses the registers of dead tiles): the shipped and default
configs need at most 1.8 KiB a thread by it, and a config near the limit spills most of its tiles.
"""

from __future__ import annotations

import math

from ...dsl.errors import CapacityError, UnsupportedError
from ...dsl.ir import Module, Op
from . import gather_pipeline
from .arch import WARP_GROUP, Arch
from .plan import make_plan


def _stages_of(module: Module) -> dict[int, int]:
    depth: dict[int, int] = {}

    def visit(block, stages):
        for op in block.ops:
            if op.result is not None:
                depth[op.result.id] = stages
            for r in op.regions:
                visit(r, op.attrs.get("stages") or stages if op.name == "for" else stages)

    visit(module.body, 1)
    return depth


MAX_REGISTERS = 255  # 32-bit registers one thread can address on sm90 and sm100
REGISTER_LIMIT = 4 * MAX_REGISTERS * 4  # bytes of register tiles a thread, all counted live at once


def _nbytes(op: Op) -> int:
    return int(op.result.type.numel()) * op.result.type.dtype.bits // 8


def register_tiles(module: Module, arch: Arch, plan) -> list[tuple[Op, int]]:
    """(op, bytes) of every tile the block holds in registers: fragments, the fragment a TMEM
    accumulator is drained into, on sm100 the product fragment of a gemm into a fragment, and the
    fragment a reduction laid out anew reduces into."""
    tiles = [(op, _nbytes(op)) for op in module.walk()
             if op.result is not None and plan.scope[op.result.id] in ("fragment", "tmem")]
    if arch.has_tmem:
        into = {op.args[2].id for op in module.walk() if op.name == "gemm" and plan.scope[op.args[2].id] == "fragment"}
        tiles += [(op, _nbytes(op)) for op in module.walk() if op.result is not None and op.result.id in into]
    tiles += [(op, _nbytes(op)) for op in module.walk() if id(op) in plan.relayout]
    return tiles


def _loop_locals(module: Module) -> dict[int, int]:
    """Value id -> the outermost loop (its op's id) that holds the value's definition and every
    use, for the values that live within one outermost loop. TileLang merges a kernel's shared
    buffers by lifetime, so two such loops run one after the other share their buffers' bytes
    (sparse decode's loop over ring rows and its loop over compressed rows, one row format
    each)."""
    home: dict[int, int | None] = {}
    local: dict[int, int] = {}

    def visit(block, loop):
        for op in block.ops:
            for a in op.args:
                if home.get(a.id) != loop:  # a use outside the loop it was made in (or made outside any)
                    local.pop(a.id, None)
            if op.result is not None:
                home[op.result.id] = loop
                if loop is not None:
                    local[op.result.id] = loop
            for r in op.regions:
                visit(r, loop if loop is not None or op.name != "for" else id(op))

    visit(module.body, None)
    return local


def _ahead_copies(module: Module, plan) -> dict[int, int]:
    """Value id -> copies, for the shared tiles of gather-pipelined loops' stage 0 (a gather's
    rows, the index tile it reads): TileLang keeps one a stage (``gather_pipeline.py``)."""
    out: dict[int, int] = {}
    for loop in module.walk():
        if loop.name == "for" and gather_pipeline.has_gather(loop):
            body = loop.regions[0].ops
            for i in gather_pipeline.stage_zero(body, plan.scope) or ():
                if body[i].result is not None and plan.scope.get(body[i].result.id) == "shared":
                    out[body[i].result.id] = int(loop.attrs["stages"])
    return out


def usage(module: Module, arch: Arch, threads: int | None = None, pipelined_gathers: bool = False) -> dict[str, int]:
    plan = make_plan(module, arch, threads, pipelined_gathers)
    stages = _stages_of(module)
    ahead = _ahead_copies(module, plan) if pipelined_gathers else {}
    local = _loop_locals(module)
    smem = tmem_cols = 0
    by_loop: dict[int, int] = {}  # shared bytes of the tiles that live within one outermost loop
    # a buffer that vector code rewrites takes TMEM on sm100 only where a gemm writes it (each gemm
    # goes into a fresh TMEM tile that is then added in); a plain vector buffer stays in registers
    gemm_written = {o.args[2].id for o in module.walk() if o.name == "gemm"}
    products: set[tuple[int, ...]] = set()  # the shapes of the fresh product tiles (plan.product_tile)
    for op in module.walk():
        v = op.result
        if v is None:
            continue
        nbytes = _nbytes(op)
        scope = plan.scope[v.id]
        if scope == "shared":
            nbytes *= stages[v.id] if op.name == "load" else ahead.get(v.id, 1)
            if v.id in local:
                by_loop[local[v.id]] = by_loop.get(local[v.id], 0) + nbytes
            else:
                smem += nbytes
        elif v.id in plan.staged:
            smem += nbytes
        if scope == "tmem":
            tmem_cols += int(v.type.shape[-1])
        elif arch.has_tmem and v.id in plan.mutated and v.id in gemm_written:
            products.add(tuple(int(d) for d in v.type.shape))  # its fresh product tile: one a shape
    tmem_cols += sum(shape[-1] for shape in products)
    smem += max(by_loop.values(), default=0)
    smem += sum(math.prod(plan.reduce_pad[id(op)]) * op.args[0].type.dtype.bits // 8
                for op in module.walk() if id(op) in plan.reduce_pad)
    smem += sum(_nbytes(op) for op in module.walk() if id(op) in plan.relayout)
    registers = sum(n for _, n in register_tiles(module, arch, plan))
    return {"shared": smem, "tmem_columns": tmem_cols, "register_bytes": registers}


def check_capacity(module: Module, arch: Arch, knobs: dict) -> dict[str, int]:
    threads = int(knobs.get("threads", 128))
    use = usage(module, arch, threads, bool(knobs.get("gather_pipeline")))
    detail = f"kernel {module.name} config {module.config}"
    if use["shared"] > arch.smem_bytes:
        raise CapacityError(arch.name, "shared memory", use["shared"], arch.smem_bytes, detail)
    if arch.has_tmem and use["tmem_columns"] > arch.tmem_columns:
        raise CapacityError(arch.name, "TMEM", use["tmem_columns"] * 128 * 4, arch.tmem_columns * 128 * 4,
                            detail + f"; {use['tmem_columns']} of {arch.tmem_columns} columns")
    per_thread = -(-use["register_bytes"] // threads)
    if per_thread > REGISTER_LIMIT:
        op, nbytes = max(register_tiles(module, arch, make_plan(module, arch, threads)), key=lambda t: t[1])
        t = op.result.type
        raise CapacityError(arch.name, "registers per thread", per_thread, REGISTER_LIMIT,
                            f"the register tiles over {threads} threads, all counted live; the largest is "
                            f"{t.dtype.name}[{'x'.join(str(int(d)) for d in t.shape)}] at this line, "
                            f"{-(-nbytes // threads)} bytes a thread; the limit is 4 x {MAX_REGISTERS} "
                            f"registers of 4 bytes (past it most tiles live in local memory): use smaller "
                            f"tiles or more threads; {detail}", loc=op.loc)
    check_fragment_layouts(module, arch, threads)
    return use


def check_fragment_layouts(module: Module, arch: Arch, threads: int) -> None:
    """TileLang 0.1.15 spreads a register tile's elements over the block's threads evenly, or takes
    the layout of a larger loop that reads it (a broadcast row vector) or of a gemm: a tile with
    more elements than threads that are not a whole multiple of them, and no such reader, has no
    layout ("no available layout found", naming neither the buffer nor the line). At 256 threads
    3 x 5, 200, 768 and 1536 elements lower, 257, 300, 384, 640 and 3 x 300 do not (384 and 640 do
    at 128); a 192-element scale vector broadcast over a 128 x 192 tile lowers at 128 threads.
    Powers of two are not the rule: attention's 128 x 176 key blocks are 88 whole multiples of 256.
    Refused here at the tile's line."""
    def fits(n: int) -> bool:
        return n <= threads or n % threads == 0

    readers: dict[int, list[Op]] = {}
    for op in module.walk():
        into = op.attrs.get("into") if op.name == "map" else None
        for v in {*(a.id for a in op.values()), *((into.id,) if into is not None else ())}:
            readers.setdefault(v, []).append(op)
    for op, _ in register_tiles(module, arch, make_plan(module, arch, threads)):
        t = op.result.type
        n = int(t.numel())
        if fits(n):
            continue
        laid_out_by = [r for r in readers.get(op.result.id, []) if r.name == "gemm" or (
            r.name == "map" and fits(int((r.result or r.attrs["into"]).type.numel())))]
        if laid_out_by:
            continue
        shape = "x".join(str(int(d)) for d in t.shape)
        raise UnsupportedError(f"{arch.name}: a register tile {t.dtype.name}[{shape}] of {n} elements cannot "
                               f"be laid out over {threads} threads by TileLang: a tile of more elements than "
                               f"threads needs a whole multiple of them (pad it, e.g. with dsl.next_pow2, or "
                               f"change threads) (config {module.config})", op.loc)


def check_warp_groups(module: Module, arch: Arch, knobs: dict) -> None:
    """A gemm runs on whole warp groups (wgmma on sm90, the tcgen05 issue and its drain on sm100):
    a block of one or two warps, which the ``threads`` knob allows a kernel without a gemm, is
    refused at the first gemm's line."""
    threads = int(knobs.get("threads", 128))
    gemm = next((op for op in module.walk() if op.name == "gemm"), None)
    if gemm is not None and threads % WARP_GROUP:
        raise UnsupportedError(f"{arch.name}: a gemm needs whole warp groups of {WARP_GROUP} threads; "
                               f"threads={threads} suits only a kernel without a gemm (config {module.config})",
                               gemm.loc)


def check_warp_rows(module: Module, arch: Arch, knobs: dict) -> None:
    """On sm90 an accumulator that vector code reads row-wise is split by rows over every warp
    (TileLang's FullRow policy), 16 rows a warp; a tile with fewer rows than that cannot be laid
    out (TileLang fails late with "Layout infer conflict") unless the column split takes it
    (``plan.col_splittable``: whole m64 rows and 8-column multiples per warp group)."""
    if arch.has_tmem:
        return
    warps = int(knobs.get("threads", 128)) // 32
    plan = make_plan(module, arch, warps * 32)
    for op in module.walk():
        if op.name == "gemm" and op.args[2].id in plan.col_split:
            continue  # split by columns instead (plan.py)
        if op.name == "gemm" and (op.args[2].id in plan.full_row or knobs.get("full_row")):
            rows = int(op.args[2].type.shape[0])
            if rows % (16 * warps):
                fix = f"use threads of at most {max(128, rows * 2)} or a taller tile"
                how = "read row-wise" if op.args[2].id in plan.full_row else "split by rows (full_row)"
                raise UnsupportedError(f"{arch.name}: a {rows}-row accumulator {how} cannot be split over "
                                       f"{warps} warps (16 rows each); {fix} (config {module.config})", op.loc)


def check_tcgen05_atoms(module: Module, arch: Arch) -> None:
    """sm100: every gemm tile needs a tcgen05 atom that TileLang 0.1.15 can lower in one CTA
    (a 64-row tile takes the .ws atom, whose N is a multiple of 64 for 16-bit inputs). TileLang
    itself would fail late with "TCGEN05 meta not initialized"; this names the gemm's line."""
    if not arch.has_tmem:
        return
    from .toolchain import tcgen05_atom, tilelang_version

    for op in module.walk():
        if op.name != "gemm":
            continue
        m, n, k = (int(d) for d in op.gemm_mnk())
        dtype = op.args[0].type.dtype
        if tcgen05_atom(m, n, k, dtype.tilelang_name) is False:
            raise UnsupportedError(f"{arch.name}: no tcgen05 instruction lowers a {m} x {n} x {k} {dtype.name} gemm "
                                   f"tile in one CTA (TileLang {tilelang_version()}); a 64-row tile needs N a "
                                   "multiple of 64 for 16-bit inputs, or use 128 rows", op.loc)


def check_tmem_drains(module: Module, arch: Arch, knobs: dict) -> None:
    """sm100: TileLang 0.1.15 cannot lay out the drain of a 64-row TMEM accumulator whose columns,
    halved and split over the block's warp groups, are more than 32 and not a multiple of 32: it
    fails late with "Composition stride divisibility: rest_stride=48, curr_shape=32" at 64 x 192
    and 256 threads. Measured on 2026-12-07 (a gemm lowered over BM 64 / 128 / 256, BN 32 to 256
    and 128 / 256 / 512 threads), that is the one failing combination; the rule refuses no other
    of them. It met a user: the cost model's choice for V4.1's router at a prefill chunk
    (N = 384 in two tiles of 192).

    Where a tile of the accumulator's shape is reduced along its rows (attention's row max and sum),
    fewer than 32 columns a group must also be a power of two: flash_attention at D = 64 fails with
    "XOR-butterfly AllReduce requires logical_width ... a power of two" at 64 x 192 and 512 threads
    (24 columns). Measured on 2026-12-08 over BM 64 / 128, BN 64 / 128 / 192 / 176 / 32 and 128 /
    256 / 512 threads, that is the one failing combination the first rule leaves; the cost model
    chose it for a causal 5-head, 307-row attention (the GPU sweep's seeded random shapes)."""
    if not arch.has_tmem:
        return
    groups = max(1, int(knobs.get("threads", 128)) // 128)
    reduced = {tuple(str(d) for d in op.args[0].type.shape) for op in module.walk()
               if op.name == "reduce" and op.attrs.get("axis") == 1}
    for op in module.walk():
        if op.name != "gemm":
            continue
        m, n, _ = (int(d) for d in op.gemm_mnk())
        columns = n / 2 / groups
        if m != 64 or columns % 32 == 0:
            continue
        if columns > 32:
            why = "not a multiple of 32"
        elif (str(m), str(n)) in reduced and int(columns) & (int(columns) - 1):
            why = "fewer than 32 and not a power of two, reduced along its rows"
        else:
            continue
        raise UnsupportedError(f"{arch.name}: TileLang cannot lay out the TMEM drain of a 64 x {n} accumulator "
                               f"over {groups} warp groups ({columns:g} columns each, {why}); "
                               "use 128 rows or another thread count", op.loc)
