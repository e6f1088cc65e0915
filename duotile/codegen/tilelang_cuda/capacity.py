"""Static resource check for CUDA targets: shared memory per block, TMEM columns, and on sm90 the
warp layout of row-split (FullRow) wgmma accumulators.

TileLang does not check shared memory (a 384 KiB kernel builds and fails only at launch), so
every config is checked here first. Shared bytes: each shared tile, times the pipeline depth
when it is loaded inside a pipelined loop. TMEM: fp32 accumulator columns, 512 per SM.
"""

from __future__ import annotations

from ...dsl.errors import CapacityError, UnsupportedError
from ...dsl.ir import Module
from .arch import Arch
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


def usage(module: Module, arch: Arch, threads: int | None = None) -> dict[str, int]:
    plan = make_plan(module, arch, threads)
    stages = _stages_of(module)
    smem = tmem_cols = 0
    for op in module.walk():
        v = op.result
        if v is None:
            continue
        nbytes = int(v.type.numel()) * v.type.dtype.bits // 8
        scope = plan.scope[v.id]
        if scope == "shared":
            smem += nbytes * (stages[v.id] if op.name == "load" else 1)
        elif v.id in plan.staged:
            smem += nbytes
        if scope == "tmem" or (arch.has_tmem and v.id in plan.mutated):
            tmem_cols += int(v.type.shape[-1])
    return {"shared": smem, "tmem_columns": tmem_cols}


def check_capacity(module: Module, arch: Arch, knobs: dict) -> dict[str, int]:
    use = usage(module, arch, int(knobs.get("threads", 128)))
    detail = f"kernel {module.name} config {module.config}"
    if use["shared"] > arch.smem_bytes:
        raise CapacityError(arch.name, "shared memory", use["shared"], arch.smem_bytes, detail)
    if arch.has_tmem and use["tmem_columns"] > arch.tmem_columns:
        raise CapacityError(arch.name, "TMEM", use["tmem_columns"] * 128 * 4, arch.tmem_columns * 128 * 4,
                            detail + f"; {use['tmem_columns']} of {arch.tmem_columns} columns")
    return use


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
