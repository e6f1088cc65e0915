"""assign_memory: map memory roles to a target's scopes and check that every scope fits.

The target supplies a ``MemoryModel`` (``duotile.passes.memory_model``): role -> scope,
scope capacities and the byte cost of a value. The pass

1. writes ``attrs["scope"]`` on every op that defines a tile (alloc, load, gather, map,
   reduce, move, ...), from ``model.scope_of(result)``;
2. computes each value's live range on the structured IR: from its definition to its last
   use, extended to the end of any loop that uses it but does not define it (a value read in
   every iteration, or a buffer carried across iterations, stays live for the whole loop);
3. charges a value that one of ``model.staged_ops`` (loads, transfers) produces inside a
   pipelined loop of ``stages`` S for S copies (the
   multi-buffering the target must honour, so a config that only fits single-buffered is
   rejected instead of silently downgraded);
4. raises ``CapacityError(target, memory, needed, capacity, detail)`` for the first scope (in
   ``model.capacities`` order) whose peak live bytes exceed ``model.capacity(scope, module)``;
   ``detail`` lists the largest values live at the peak with their source lines, and any
   other scope that overflows too.

It changes nothing else and never looks at the target's name.

Before (gemm, BM=BN=128, BK=64, STAGES=3, Ascend model)::

    %buf0 = alloc() fill=0.0 -> f32[128x128] accumulator
    for k < 128 pipelined(stages=3) {
      %a1 = load a[128*m, 64*k] -> bf16[128x64] operand
      %b2 = load b[128*n, 64*k] -> bf16[128x64] operand
      gemm(%a1, %b2, %buf0) transpose_a=False transpose_b=True
    }

After (l1 peak 3 x (16 + 16) KiB = 96 KiB, l0c 64 KiB)::

    %buf0 = alloc() fill=0.0 scope=l0c -> f32[128x128] accumulator
    for k < 128 pipelined(stages=3) {
      %a1 = load a[128*m, 64*k] -> bf16[128x64] operand scope=l1
      %b2 = load b[128*n, 64*k] -> bf16[128x64] operand scope=l1
      ...

With BM=BN=256, BK=128, STAGES=5 the same kernel raises
``ascend950: L1 overflow: needs 655360 bytes (640.0 KiB), capacity 524288 bytes (512.0 KiB); ...``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dsl.errors import CapacityError
from ..dsl.ir import Block, Module, Op, Value
from .memory_model import MemoryModel


@dataclass
class _Live:
    value: Value
    op: Op
    scope: str
    nbytes: int
    start: int
    end: int


@dataclass
class ScopeUsage:
    """Peak live bytes of one scope, and the values live at that peak."""

    scope: str
    peak: int = 0
    at: list[_Live] = field(default_factory=list)


def assign_memory(module: Module, model: MemoryModel) -> Module:
    usage = memory_usage(module, model)
    order = list(model.capacities) + sorted(set(usage) - set(model.capacities))
    over = [(usage[s], model.capacity(s, module)) for s in order if s in usage]
    over = [(use, cap) for use, cap in over if cap is not None and use.peak > cap]
    if over:
        use, cap = over[0]
        top = sorted(use.at, key=lambda x: -x.nbytes)[:4]
        detail = "live at the peak: " + ", ".join(
            f"{x.value!r} {x.value.type}"
            + (f" x{x.nbytes // model.cost(x.value)} stages" if x.nbytes > model.cost(x.value) else "")
            + f" = {x.nbytes / 1024:.1f} KiB" + (f" (line {x.op.loc.line})" if x.op.loc else "")
            for x in top)
        for other, ocap in over[1:]:
            detail += f"; {model.label(other.scope)} also overflows: {other.peak} > {ocap} bytes"
        raise CapacityError(model.target, model.label(use.scope), use.peak, cap, detail,
                            top[0].op.loc if top else None)
    return module


def memory_usage(module: Module, model: MemoryModel) -> dict[str, ScopeUsage]:
    """Annotate scopes and return the peak usage of each scope (no capacity check)."""
    walker = _Walker(model)
    walker.block(module.body, [])
    lives = walker.finish()
    usage: dict[str, ScopeUsage] = {}
    for scope in {x.scope for x in lives}:
        mine = [x for x in lives if x.scope == scope]
        best = ScopeUsage(scope)
        for point in sorted({x.start for x in mine}):
            live = [x for x in mine if x.start <= point <= x.end]
            total = sum(x.nbytes for x in live)
            if total > best.peak:
                best = ScopeUsage(scope, total, live)
        usage[scope] = best
    return usage


class _Walker:
    def __init__(self, model: MemoryModel):
        self.model = model
        self.pos = 0
        self.defs: dict[int, tuple[Value, Op, str, int, int, list]] = {}  # id -> (value, op, scope, stages, pos, loops)
        self.uses: dict[int, list[tuple[int, list]]] = {}
        self.loop_end: dict[int, int] = {}

    def block(self, block: Block, loops: list):
        for op in block.ops:
            self.pos += 1
            here = self.pos
            for v in _reads(op):
                self.uses.setdefault(v.id, []).append((here, list(loops)))
            if op.result is not None:
                scope = self.model.scope_of(op.result)
                op.attrs["scope"] = scope
                stages = 1
                if op.name in self.model.staged_ops:
                    stages = next((lp.attrs.get("stages") or 1 for lp in reversed(loops) if lp.name == "for"), 1)
                self.defs[op.result.id] = (op.result, op, scope, stages, here, list(loops))
            for region in op.regions:
                self.block(region, loops + [op])
            if op.regions:
                self.loop_end[id(op)] = self.pos

    def finish(self) -> list[_Live]:
        out = []
        for vid, (value, op, scope, stages, start, def_loops) in self.defs.items():
            end = start
            for pos, loops in self.uses.get(vid, []):
                end = max(end, pos)
                for lp in loops:  # a use inside a loop the value was not defined in: live all of it
                    if not any(lp is d for d in def_loops):
                        end = max(end, self.loop_end[id(lp)])
            out.append(_Live(value, op, scope, self.model.cost(value, stages), start, end))
        return out


def _reads(op: Op):
    yield from op.values()
    into = op.attrs.get("into")
    if isinstance(into, Value):
        yield into
