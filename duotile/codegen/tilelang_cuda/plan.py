"""What the CUDA emitter decides before it writes a line: where each value lives.

Rules (each a target lowering rule any kernel can hit, never a kernel special case):
- a tile that feeds a gemm as ``b`` (or as ``a`` on TMEM arches) lives in shared memory;
  other loads with role ``operand`` too; ``vector`` tiles and map results are fragments.
- an ``accumulator`` buffer is a fragment on sm90. On sm100 it lives in TMEM, drained through
  a fragment before vector work reads it, unless vector ops also write it (``map ... into``):
  then it stays a fragment and each gemm into it goes through a fresh TMEM tile that is added in.
- a gemm whose accumulator is reduced or rewritten by vector work gets the FullRow warp policy,
  so that each row lives within one warp group and row reductions stay in registers.
- a zero-filled accumulator consumed first by a gemm is cleared by the gemm (``clear_accum``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...dsl.ir import Module, Op, Role, Value
from .arch import Arch
from .exprs import index


@dataclass
class Plan:
    scope: dict[int, str] = field(default_factory=dict)  # value id -> shared | fragment | tmem
    mutated: set[int] = field(default_factory=set)  # accumulators that vector ops write
    full_row: set[int] = field(default_factory=set)  # accumulators needing FullRow
    clear_by_gemm: dict[int, str] = field(default_factory=dict)  # gemm op id -> clear_accum expr
    skip_fill: dict[int, str] = field(default_factory=dict)  # alloc id -> 'same' | 'loop': a gemm clears it
    staged: set[int] = field(default_factory=set)  # fragment values copied to shared for a gemm


def make_plan(module: Module, arch: Arch) -> Plan:
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
    gemm_b = {op.args[1].id for op in ops if op.name == "gemm"}
    gemm_a = {op.args[0].id for op in ops if op.name == "gemm"}
    for op in ops:
        v = op.result
        if v is None:
            continue
        plan.scope[v.id] = _scope(op, v, arch, plan, v.id in gemm_b, v.id in gemm_a)
        if op.name != "load" and plan.scope[v.id] == "fragment":
            if v.id in gemm_b or (v.id in gemm_a and arch.has_tmem):
                plan.staged.add(v.id)
    _find_gemm_clears(module, plan)
    return plan


def _scope(op: Op, v: Value, arch: Arch, plan: Plan, feeds_b: bool, feeds_a: bool) -> str:
    role = v.type.role
    if op.name == "alloc" and role is Role.ACCUMULATOR:
        return "tmem" if arch.has_tmem and v.id not in plan.mutated else "fragment"
    if op.name == "load" and (role is Role.OPERAND or feeds_b or (feeds_a and arch.has_tmem)):
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
