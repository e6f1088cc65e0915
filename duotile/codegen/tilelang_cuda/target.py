"""The ``sm90`` and ``sm100`` targets: Tile IR -> TileLang (CUDA dialect) -> CUDA C++ -> cubin."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from ...dsl.ir import Module
from ...dsl.tunables import choice
from ...passes.fold_bounds import fold_bounds
from ...passes.forward_copies import forward_copies
from ...passes.fuse_elementwise import fuse_elementwise
from ...passes.mark_short_loops import mark_short_loops, max_trips
from ...passes.prefetch_loads import prefetch_loads
from ...passes.split_phases import split_phases
from ..target import Artifact, Target, lowering_error, register_target
from . import fit_threads, gather_pipeline, tma_store, toolchain
from .arch import SM90, SM100, Arch
from .capacity import check_capacity, check_tcgen05_atoms, check_tmem_drains, check_warp_groups, check_warp_rows
from .emit import emit_module, ws_mode
from .lowered_bounds import check_lowered_bounds
from .overlap import check_overlap
from .persistent import check_persistent, shareable
from .plan import make_plan


def _count(lo: int):
    return lambda v: type(v) is int and v >= lo


# what a config may set beyond the searched values (dsl.tunables: ``also``)
_PANEL_ROWS = (_count(1), "any number of rows >= 1")
_BLOCK_COUNT = (_count(1), "a block count >= 1")
_WS_BOOLEANS = (lambda v: type(v) is bool, "True / False (older tables: auto / off)")


# threads of a kernel without a gemm may be one or two warps, for a block whose work is a chain of
# row reductions over one short row (a router's picks): a reduction over one warp is shuffles
# alone, one over eight adds a shared-memory exchange and two barriers. A gemm keeps whole warp
# groups (capacity.check_warp_groups).
_WARPS = (64, 32)  # one or two warps
_SMALL_BLOCK = (lambda v: v in _WARPS, " or ".join(map(str, sorted(_WARPS))) + " for a kernel without a gemm")
SMALL_BLOCKS = choice(256, 128, 512, *_WARPS)


class TileLangCuda(Target):
    stages = ("ir", "tilelang", "cuda", "ptx", "sass")
    runs_on = "cuda"

    def __init__(self, arch: Arch):
        self.arch = arch
        self.name = arch.name
        self.least_tile = arch.least_tile
        # threads per block (warp groups that split a wgmma tile evenly);
        # raster: rows of blocks swept together for L2 reuse (0 = off);
        # fp8_promote_k (sm90): add the fp8 partial sums into the fp32 accumulator every N elements of K
        # (0: never); 128 is DeepGEMM's and CUTLASS's interval
        # ftz: fp32 denormals flushed to zero (nvcc --ftz=true), as FA3 and most LLM kernels build;
        # without it every exp2 is a range check and two predicated multiplies around MUFU.EX2
        self.knobs = {"threads": choice(256, 128, 512, also=_SMALL_BLOCK),
                      "raster": choice(0, 8, 16, also=_PANEL_ROWS), "ftz": choice(True, False)}
        if not arch.has_tmem:
            self.knobs["fp8_promote_k"] = choice(128, 256, 512, 0)
            # overlap: run a dependent second gemm one iteration behind (FA3's schedule), see overlap.py
            self.knobs["overlap"] = choice(False, True)
            # warp_specialize: for a pipelined loop, TileLang's producer warp group issuing TMA ("auto"),
            # duotile's hand-scheduled producer / consumer roles with wgmma kept in flight ("manual",
            # manual_ws.py), or every warp loading and computing ("off": tl.disable_warp_specialized)
            self.knobs["warp_specialize"] = choice("auto", "manual", "off", also=_WS_BOOLEANS)
            # persistent: one block per SM walks the output tiles (persistent.py; manual only);
            # an integer is a block count
            self.knobs["persistent"] = choice(False, True, also=_BLOCK_COUNT)
            # full_row: every gemm tile split by rows over the warp groups (TileLang's FullRow policy),
            # so each warp group issues wgmma as wide as the tile's N (one m64n256 where the default
            # square split issues two m64n128 and reads the A tile twice from shared memory)
            self.knobs["full_row"] = choice(False, True)
            # cluster: with a persistent grid, blocks in pairs that share a tile (a gemm's B or A,
            # attention's K and V) by TMA multicast, so L2 serves it once for two tiles (persistent.py)
            self.knobs["cluster"] = choice(1, 2)
            # tma_store: with manual, the output tile goes out through shared memory and a TMA
            # store, in chunks of whole rows that fit beside the rings (tma_store.py)
            self.knobs["tma_store"] = choice(False, True)
            # gather_pipeline: a pipelined loop that gathers rows into shared memory issues the next
            # block's copies before it waits for this one's (gather_pipeline.py; TileLang's own
            # schedule awaits each block's rows where it issues them)
            self.knobs["gather_pipeline"] = choice(False, True)

    def knobs_for(self, module: Module) -> dict:
        """fp8_promote_k only matters with an fp8 gemm, overlap only with two gemms in a pipelined loop,
        warp_specialize only with a pipelined loop, full_row only with a gemm whose accumulator is not
        split by rows anyway, cluster only where a pair of blocks shares a loaded tile; ftz is a
        numerics choice, set by hand, never searched. A kernel of several phases (a K split and its
        combine) keeps the knobs any of its phases can use."""
        used = set().union(*(self._used_knobs(p) for p in split_phases(module)))
        knobs = {k: s for k, s in self.knobs.items() if k in used}
        if not any(op.name == "gemm" for op in module.walk()):
            knobs["threads"] = SMALL_BLOCKS  # no warp group to keep whole
        return knobs

    def fitted_knobs(self, phases: list[Module], programs: int | None) -> list[dict]:
        """A kernel without a gemm: a block no larger than its tiles fill, unless its launch has a
        fixed size that the default block runs in one wave (fit_threads.py)."""
        default = self.knobs["threads"].default
        return [{"threads": t}
                for t in fit_threads.thread_choices(phases, default, programs, self.arch.resident_threads)]

    def _used_knobs(self, module: Module) -> set[str]:
        """The knobs that can change one phase's code."""
        ops = list(module.walk())
        fp8 = any(op.name == "gemm" and op.args[0].type.dtype.bits == 8 for op in ops)
        pipelined = [op for op in ops if op.name == "for" and op.attrs.get("stages")]
        two_gemm_loop = any(sum(o.name == "gemm" for o in op.regions[0].ops) >= 2 for op in pipelined)
        gathering = any(gather_pipeline.has_gather(op) for op in pipelined)
        # the fusing passes rewrite blocks in place: plan on a copy
        row_split = make_plan(self._fused(copy.deepcopy(module)), self.arch).full_row
        gemm = any(op.name == "gemm" and op.args[2].id not in row_split for op in ops)
        drop = ({"fp8_promote_k"} if not fp8 else set()) | ({"overlap"} if not two_gemm_loop else set()) \
            | ({"warp_specialize", "persistent", "cluster", "tma_store"} if not pipelined else set()) \
            | ({"full_row"} if not gemm else set()) | ({"gather_pipeline"} if not gathering else set()) \
            | ({"cluster"} if not shareable(module.grid) else set()) \
            | {"ftz"}
        return set(self.knobs) - drop

    def phase_knobs(self, module: Module, knobs: dict) -> dict:
        """A phase without a pipelined loop (a split reduction's combine) keeps the default schedule:
        warp specialisation, the two-gemm rotation and persistence are schedules of such a loop. So
        does a kernel whose pipelined loops run at most once at every grid point (causal attention
        over fewer rows than two key blocks): a ring over one step pipelines nothing, and the
        hand-scheduled split would refuse it, a tuned config chosen for longer rows included."""
        schedule = {k for k in ("warp_specialize", "overlap", "persistent", "cluster", "tma_store") if k in self.knobs}
        if all(knobs.get(k, self.knobs[k].default) == self.knobs[k].default for k in schedule):
            return knobs  # the default schedule already (most calls: the config search's checks)
        loops = [op for op in module.walk() if op.name == "for" and op.attrs.get("stages")]
        if loops and not self._runs_at_most_once(module, loops):
            return knobs
        if not loops and module.phase is None:
            return knobs
        return {k: (self.knobs[k].default if k in schedule else v) for k, v in knobs.items()}

    @staticmethod
    def _runs_at_most_once(module: Module, loops) -> bool:
        """Whether every loop of ``loops`` runs at most once at every grid point (static extents)."""
        extents = dict(zip(module.grid.attrs["vars"], module.grid.attrs["extents"]))
        trips = [max_trips(op.attrs["start"], op.attrs["extent"], extents) for op in loops]
        return all(t is not None and t <= 1 for t in trips)

    def start_points(self, module: Module) -> list[dict]:
        """sm90: duotile's warp specialisation for a pipelined loop, with the two-gemm rotation
        where the loop has that shape (two knob steps from the default, worth 10% on attention),
        and the same on a persistent grid."""
        knobs = self.knobs_for(module)
        if "warp_specialize" not in knobs:
            return []
        manual = {"warp_specialize": "manual", **({"overlap": True} if "overlap" in knobs else {})}
        return [manual, {**manual, "persistent": True}]

    @property
    def mma_atom(self) -> tuple[int, int, int]:
        return self.arch.mma_atom

    @property
    def modelled(self) -> bool:
        return self.arch.modelled

    @property
    def machine(self):
        from .tuning import MACHINES

        return MACHINES[self.arch.name]

    def tuning_limits(self, usage, knobs):
        from .tuning import cuda_limits

        return cuda_limits(self.arch, usage, knobs)

    def toolchain(self) -> dict[str, str]:
        return {"tilelang": toolchain.tilelang_version(), "nvcc": toolchain.nvcc_version()}

    @staticmethod
    def _fused(module: Module) -> Module:
        # vector code reads an accumulator where it lives (sm90: the register fragment; sm100: one
        # tcgen05.ld drain into a fragment after each write), so a plain copy between them can go
        return mark_short_loops(forward_copies(fold_bounds(fuse_elementwise(module))))

    @staticmethod
    def static_under(config: dict[str, Any]) -> bool:
        """Whether a config needs every size static: clusters pair blocks along a grid axis whose
        extent must be even, which a dynamic size cannot promise (such builds are one per size)."""
        return int(config.get("cluster", 1) or 1) > 1

    def lower(self, module: Module, knobs: dict[str, Any]) -> Module:
        skip = gather_pipeline.has_gather if knobs.get("gather_pipeline") else None
        module = self._fused(prefetch_loads(module, skip=skip))
        check_capacity(module, self.arch, knobs)
        check_warp_groups(module, self.arch, knobs)
        check_warp_rows(module, self.arch, knobs)
        check_tcgen05_atoms(module, self.arch)
        check_tmem_drains(module, self.arch, knobs)
        check_overlap(module, self.name, knobs, ws_mode(knobs))
        check_persistent(module, self.name, knobs, ws_mode(knobs), self.arch.has_tmem)
        tma_store.check(module, self.name, knobs, ws_mode(knobs))
        return module

    def generate(self, module: Module, knobs: dict[str, Any]) -> Artifact:
        from ...dsl.printer import format_module

        text = emit_module(module, self.arch, knobs)
        return Artifact(module.name, self.name, stages={"ir": format_module(module), "tilelang": text},
                        meta={"entry": f"{module.name}_kernel"})

    def build(self, artifact: Artifact, workdir: str) -> Artifact:
        work = Path(workdir)
        py = work / "kernel_tilelang.py"
        py.write_text(artifact.stages["tilelang"])
        t0 = time.perf_counter()
        prim, configs = toolchain.load_generated(str(py), artifact.meta["entry"])
        try:
            cuda, bounds = toolchain.lower_checked(prim, self.arch.sm, configs)
        except Exception as err:  # TileLang's own errors name its passes, not the config or the source
            raise lowering_error(self.name, f"TileLang {toolchain.tilelang_version()}", artifact, err) from err
        artifact.timings["tilelang_lower"] = time.perf_counter() - t0
        check_lowered_bounds(self.name, artifact, bounds)
        artifact.stages["cuda"] = cuda
        cu = work / "kernel.cu"
        cu.write_text(cuda)
        t0 = time.perf_counter()
        flags = toolchain.device_flags(configs)  # what tilelang.compile passes nvcc on the GPU
        report = toolchain.nvcc(str(cu), self.arch.sm, str(work / "kernel.cubin"), "cubin", flags,
                                ptx_path=str(work / "kernel.ptx"))
        artifact.timings["nvcc"] = time.perf_counter() - t0
        artifact.meta["ptxas"] = toolchain.ptxas_stats(report)  # spills: a config slower than it looks
        artifact.files["cubin"] = str(work / "kernel.cubin")
        artifact.stages["ptx"] = (work / "kernel.ptx").read_text()
        sass = toolchain.sass(str(work / "kernel.cubin"))
        if sass is not None:
            artifact.stages["sass"] = sass
        return artifact

    def load(self, artifact: Artifact, module: Module):
        from .launch import make_launcher

        return make_launcher(artifact, module, self.arch)

    def prepare_load(self, artifact: Artifact) -> bool:
        """TileLang's JIT compile of the build into its kernel cache, which ``load`` then reads
        (no GPU needed: nvcc and the host wrapper's compiler)."""
        from .launch import jit_compile

        jit_compile(artifact, self.arch)
        return True


register_target(TileLangCuda(SM90))
register_target(TileLangCuda(SM100))
