"""Registers the ``ascend950`` target: pass pipeline, TileLang Ascend source, Ascend C++ lowering."""

from __future__ import annotations

from pathlib import Path

from ...dsl.errors import CapacityError
from ...dsl.ir import Module
from ...dsl.printer import format_module
from ...dsl.tunables import choice
from ...passes.assign_memory import assign_memory
from ...passes.fold_bounds import fold_bounds
from ...passes.fuse_elementwise import fuse_elementwise
from ...passes.mark_short_loops import mark_short_loops
from ..target import Artifact, Target, lowering_error, register_target
from .capacity import AscendMemoryModel
from .check_whole_tiles import check_whole_tiles
from .emit import generate_source
from .insert_moves import insert_moves
from .lower_tilelang import lower_file, tilelang_version
from .nt_operands import nt_operands
from .rematerialize_casts import rematerialize_casts
from .split_vector_rows import split_vector_rows
from .vector_accumulators import vector_accumulators


class AscendTarget(Target):
    name = "ascend950"
    stages = ("ir", "tilelang", "ascend")
    # the generator sizes its persistent core loop and UB plan from constants: every size of a
    # dynamic dimension is specialised (one build per size), which the call's cache keys say
    dynamic_shapes = False
    # vector_split: each of a cube core's two vector cores takes half the rows of the vector tiles
    # (T.dual_copy; split_vector_rows.py) instead of both running the whole tile
    knobs = {"cores": choice(32, 24, 16), "threads": choice(128, 256, 64), "vector_split": choice(False, True)}
    mma_atom = (16, 16, 32)  # the cube's 16 x 16 fractals, 32 bytes of K
    modelled = True  # no Ascend hardware here: tuning ranks by the cost model

    @property
    def machine(self):
        from .tuning import ASCEND950

        return ASCEND950

    def tuning_limits(self, usage, knobs):
        from .tuning import ascend_limits

        return ascend_limits(usage, knobs)

    def knobs_for(self, module: Module) -> dict:
        """vector_split only with cube work in the kernel (dual_copy splits a cube result)."""
        has_gemm = any(op.name == "gemm" for op in module.walk())
        return {k: s for k, s in self.knobs.items() if k != "vector_split" or has_gemm}

    def phase_knobs(self, module: Module, knobs: dict) -> dict:
        """A phase without cube work (a split reduction's combine) keeps the vector cores unsplit:
        vector_split divides a cube result between them."""
        if module.phase is None or any(op.name == "gemm" for op in module.walk()) or "vector_split" not in knobs:
            return knobs
        return {**knobs, "vector_split": self.knobs["vector_split"].default}

    def lower(self, module: Module, knobs) -> Module:
        module = mark_short_loops(check_whole_tiles(fold_bounds(fuse_elementwise(module))))
        module = rematerialize_casts(module)
        module = nt_operands(module)
        module = vector_accumulators(module)
        module = insert_moves(module)
        if (knobs or {}).get("vector_split"):
            module = split_vector_rows(module)
        return assign_memory(module, AscendMemoryModel())

    def generate(self, module: Module, knobs) -> Artifact:
        knobs = {**self.default_knobs(), **(knobs or {})}
        return Artifact(module.name, self.name,
                        stages={"ir": format_module(module), "tilelang": generate_source(module, knobs)})

    def build(self, artifact: Artifact, workdir: str) -> Artifact:
        path = Path(workdir) / "kernel_tilelang.py"
        path.write_text(artifact.stages["tilelang"])
        try:
            artifact.stages["ascend"], artifact.timings["lower"] = lower_file(path)
        except CapacityError:
            raise
        except Exception as err:  # TileLang's own errors name its passes, not the config or the source
            raise lowering_error(self.name, f"TileLang {tilelang_version()} (Ascend)", artifact, err) from err
        artifact.meta["binary"] = "none: no bisheng/CANN on this machine; Ascend C++ source only"
        return artifact

    def toolchain(self) -> dict[str, str]:
        return {"tilelang": tilelang_version(), "generator": "ascend950-2"}


register_target(AscendTarget())
