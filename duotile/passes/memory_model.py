"""What a target tells ``assign_memory``: where each role lives and how much each scope holds.

A target subclasses ``MemoryModel`` (or fills one in) and passes it to
``duotile.passes.assign_memory.assign_memory``. The pass never asks which target it runs for;
everything target-specific is a field or a method here:

- ``target``: the name used in CapacityError messages;
- ``roles``: role -> scope name (``{Role.OPERAND: "l1", ...}``);
- ``capacities``: scope -> bytes; ``capacity(scope, module)`` may refine it per kernel
  (e.g. Ascend UB is smaller when the kernel has a SIMT region);
- ``labels``: scope -> the name printed in messages ("UB", "L0C", "shared memory");
- ``scope_of(value)``: the scope of one value (by default ``roles[value.type.role]``);
- ``staged_ops``: ops whose results are multi-buffered in a pipelined loop (the transfers the
  pipeline overlaps with compute; by default load, gather and move);
- ``cost(value, stages)``: bytes one value occupies, ``stages`` copies when a staged op makes
  it inside a pipelined loop; by default ``numel * itemsize * stages``.

A scope absent from ``capacities`` is unbounded (registers on CUDA, say): it is annotated
but never checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..dsl.ir import Module, Role, Value


@dataclass
class MemoryModel:
    target: str
    roles: dict[Role, str]
    capacities: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    staged_ops: tuple[str, ...] = ("load", "gather", "move")

    def scope_of(self, value: Value) -> str:
        return self.roles[value.type.role]

    def cost(self, value: Value, stages: int = 1) -> int:
        numel = math.prod(int(d) for d in value.type.shape)
        return math.ceil(numel * value.type.dtype.bits / 8) * max(1, stages)

    def capacity(self, scope: str, module: Module) -> int | None:
        return self.capacities.get(scope)

    def label(self, scope: str) -> str:
        return self.labels.get(scope, scope)
