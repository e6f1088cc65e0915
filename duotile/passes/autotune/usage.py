"""What the autotuner's quick filter knows about a config before compiling: the peak bytes of
tiles live at once, by role, over a bound module (``estimate_usage``), and ``Limit``, one
comparison of a need against a capacity. Each target turns a ``TileUsage`` into its own limits
(``Target.tuning_limits``); the target's build-time capacity check stays the final word.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import sympy

from ...dsl.ir import Module, Op, Role, Value

KiB = 1024
REG_OVERHEAD = 32  # registers per thread for addresses, loop counters and the like


@dataclass
class TileUsage:
    """Peak live bytes per role, plus the tiles a memory model needs by kind."""

    peak: dict[Role, int] = field(default_factory=dict)
    # peak of accumulator + vector bytes live at the same moment (what registers hold on sm90);
    # the sum of the two peaks would count tiles that are never live together
    peak_acc_vector: int = 0
    accumulators: list[tuple[int, ...]] = field(default_factory=list)  # live-at-peak accumulator shapes
    # of those, the ones vector work rewrites (an online softmax's output, rescaled each block): on a
    # TMEM target they stay in registers and each gemm multiplies into a fresh TMEM tile first
    rewritten: list[tuple[int, ...]] = field(default_factory=list)
    gemm_a: int = 0  # largest gemm A operand, bytes
    gemm_b: int = 0
    gemms: list[Op] = field(default_factory=list)
    has_vector_work: bool = False


def _bytes(v: Value) -> int:
    return int(math.ceil(int(v.type.numel()) * v.type.dtype.bits / 8))


def estimate_usage(module: Module) -> TileUsage:
    """Peak bytes of tiles live at once, by role, over a bound module."""
    order: list[tuple[Op, int]] = []  # (op, number of enclosing pipelined stages)
    loops: list[tuple[int, int]] = []  # (first index, last index) of every loop body

    def linear(block, stages):
        for op in block.ops:
            start = len(order)
            order.append((op, stages))
            for r in op.regions:
                s = op.attrs.get("stages") or 1 if op.name == "for" else stages
                linear(r, s)
            if op.name == "for":
                loops.append((start, len(order) - 1))

    linear(module.body, 1)
    defined: dict[int, tuple[int, Value, int]] = {}
    last: dict[int, int] = {}
    for i, (op, stages) in enumerate(order):
        for v in op.values():
            last[v.id] = i
        into = op.attrs.get("into")
        if isinstance(into, Value):
            last[into.id] = i
        if op.result is not None:
            mult = stages if op.result.type.role is Role.OPERAND and op.name in ("load", "gather") else 1
            defined[op.result.id] = (i, op.result, mult)
            last.setdefault(op.result.id, i)
    # a value read inside a loop but defined before it lives until the loop ends
    for vid, (d, _, _) in defined.items():
        for lo, hi in loops:
            if d < lo <= last[vid] <= hi:
                last[vid] = hi
    usage = TileUsage()
    events: dict[int, list[tuple[int, Value, int]]] = {}
    for vid, (d, v, mult) in defined.items():
        events.setdefault(d, []).append((+1, v, mult))
        # a tile read for the last time by op i is dead before op i's result is written: the
        # result may reuse its storage (elementwise work is done in place in registers / UB)
        events.setdefault(last[vid] if last[vid] > d else d + 1, []).append((-1, v, mult))
    live: dict[Role, int] = {r: 0 for r in Role}
    live_acc: dict[int, Value] = {}
    best_acc = 0
    rewritten = {op.attrs["into"].id for op, _ in order if op.name == "map" and isinstance(op.attrs.get("into"), Value)}
    for i in range(len(order) + 1):
        for sign, v, mult in sorted(events.get(i, ()), key=lambda e: e[0]):
            live[v.type.role] += sign * _bytes(v) * mult
            if v.type.role is Role.ACCUMULATOR:
                if sign > 0:
                    live_acc[v.id] = v
                else:
                    live_acc.pop(v.id, None)
        for r in Role:
            usage.peak[r] = max(usage.peak.get(r, 0), live[r])
        usage.peak_acc_vector = max(usage.peak_acc_vector, live[Role.ACCUMULATOR] + live[Role.VECTOR])
        if live[Role.ACCUMULATOR] > best_acc:
            best_acc = live[Role.ACCUMULATOR]
            usage.accumulators = [tuple(int(d) for d in a.type.shape) for a in live_acc.values()]
            usage.rewritten = [tuple(int(d) for d in a.type.shape) for a in live_acc.values() if a.id in rewritten]
    for op, _ in order:
        if op.name == "gemm":
            usage.gemms.append(op)
            usage.gemm_a = max(usage.gemm_a, _bytes(op.args[0]))
            usage.gemm_b = max(usage.gemm_b, _bytes(op.args[1]))
        elif op.name in ("ew", "map", "reduce", "cast"):
            usage.has_vector_work = True
    return usage


@dataclass(frozen=True)
class Limit:
    memory: str
    needed: sympy.Expr
    capacity: sympy.Expr
    unit: str = "bytes"

    def ok(self) -> bool:
        n, c = self.needed, self.capacity
        if _is_integer(n) and _is_integer(c):  # the usual case, and sympy's answer: no relational built
            return int(n) <= int(c)
        return bool(sympy.Le(n, c))

    def reason(self) -> str:
        n, c = int(self.needed), int(self.capacity)
        if self.unit == "bytes":
            return f"{self.memory}: needs {n / KiB:.1f} KiB > capacity {c / KiB:.1f} KiB"
        return f"{self.memory}: needs {n} {self.unit} > capacity {c} {self.unit}"


def _is_integer(v) -> bool:
    return isinstance(v, sympy.Integer) or (isinstance(v, int) and not isinstance(v, bool))


def threads_of(knobs: dict[str, Any]) -> int:
    """Threads of a CUDA CTA: the ``threads`` knob, else ``num_warps`` x 32, else 256 (assumed)."""
    if "threads" in knobs:
        return int(knobs["threads"])
    if "num_warps" in knobs:
        return 32 * int(knobs["num_warps"])
    return 256
