"""split_phases: one module per phase, so every later pass and generator sees a single grid.

A kernel with several top-level grids (a split reduction, then its combine) runs them as
separate launches, in order. Each phase keeps every tensor parameter and workspace, so the call
passes the same tensors to each; a phase's name gets its number (``gemm_splitk_p0``,
``gemm_splitk_p1``) where there is more than one. A single-grid module comes back unchanged.
"""

from __future__ import annotations

from ..dsl.ir import Block, Module
from .rewrite import Rewriter


def split_phases(module: Module) -> list[Module]:
    grids = module.body.ops
    if len(grids) == 1:
        return [module]
    return [_phase(module, i) for i in range(len(grids))]


def _phase(module: Module, i: int) -> Module:
    """Phase ``i`` as a module of its own (a copy: passes may rewrite it in place)."""
    one = Module(module.name, module.params, Block([module.body.ops[i]]), module.config, module.constants,
                 module.shapes, module.dynamic, module.batch_dim, module.source_file)
    return Rewriter().module(one, name=f"{module.name}_p{i}", phase=i)
