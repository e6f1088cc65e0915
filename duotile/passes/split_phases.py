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
    if len(module.body.ops) == 1:
        return [module]
    # each a copy: passes may rewrite it in place
    return [Rewriter().module(one, name=f"{module.name}_p{i}", phase=i) for i, one in enumerate(phase_views(module))]


def phase_views(module: Module) -> list[Module]:
    """Each grid of ``module`` as a module of its own under ``module``'s name, sharing its ops and
    parameters (not copies: for a pass that writes a new module, such as ``bind_shapes``), and the
    kernel's size conditions (``dsl.require``: each phase is called with the kernel's sizes)."""
    return [Module(module.name, module.params, Block([grid]), module.config, module.constants, module.shapes,
                   module.dynamic, module.batch_dim, module.source_file, requires=list(module.requires))
            for grid in module.body.ops]
