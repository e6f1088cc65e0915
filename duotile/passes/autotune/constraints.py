"""Constraints on a config, evaluated with sympy before anything is compiled.

A config is traced, its shapes bound (``bind_shapes``) and its elementwise chains fused
(``fuse_elementwise``, as the targets do), and then three kinds of rules are checked, each
written over the Tile IR, never over a kernel's name or its tunables' names:

- **capacity**: a generic estimator walks the IR, tracks which tiles are live at once and
  sums their bytes by role (operands multiplied by the stages of the pipelined loop that loads
  them); each target's memory model maps roles to its memories and compares with sympy:

  ======== ===========================================================================
  sm90     shared memory 227 KiB per CTA; registers 255 per thread, 64K x 32-bit per SM
  sm100    as sm90, plus tensor memory 512 columns x 128 lanes x 32-bit (accumulators)
  ascend950 UB 248 KiB (216 KiB with a SIMT vector region), L1 512 KiB, L0A / L0B 64 KiB,
           L0C 256 KiB
  ======== ===========================================================================

- **instruction shapes**: every ``gemm`` tile is a multiple of the target's MMA atom
  (wgmma m64 x n8 x 32 bytes of K on sm90, tcgen05 m64 x n16 on sm100, 16 x 16 fractals on
  the Ascend cube).
- **divisibility / waste**: a tile extent larger than the next power of two of the tensor
  dimension it walks only computes masked elements, so it is pruned; the batch dimension of a
  batch-invariant kernel is exempt (its config must serve every batch size). Callers add their
  own relations as text, e.g. ``"Mod(K, BK) == 0"`` or ``"BM * BN <= 32768"``.

A pruned config keeps every reason. ``passes/assign_memory.py`` (the Ascend memory planner)
did not exist when this was written; the estimator here is deliberately small and should be
replaced by that pass's memory model once it lands.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy

from ...dsl.errors import DslError
from ...dsl.ir import Module, Op, Role, Value
from ...dsl.kernel import KernelDef, Signature
from ..bind_shapes import bind_shapes
from ..fuse_elementwise import fuse_elementwise
from ..rewrite import Rewriter

KiB = 1024

# -- the generic estimator -------------------------------------------------------------------


@dataclass
class TileUsage:
    """Peak live bytes per role, plus the tiles a memory model needs by kind."""

    peak: dict[Role, int] = field(default_factory=dict)
    accumulators: list[tuple[int, ...]] = field(default_factory=list)  # live-at-peak accumulator shapes
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
        if live[Role.ACCUMULATOR] > best_acc:
            best_acc = live[Role.ACCUMULATOR]
            usage.accumulators = [tuple(int(d) for d in a.type.shape) for a in live_acc.values()]
    for op, _ in order:
        if op.name == "gemm":
            usage.gemms.append(op)
            usage.gemm_a = max(usage.gemm_a, _bytes(op.args[0]))
            usage.gemm_b = max(usage.gemm_b, _bytes(op.args[1]))
        elif op.name in ("ew", "map", "reduce", "cast"):
            usage.has_vector_work = True
    return usage


# -- per-target memory models ----------------------------------------------------------------


@dataclass(frozen=True)
class Limit:
    memory: str
    needed: sympy.Expr
    capacity: sympy.Expr
    unit: str = "bytes"

    def ok(self) -> bool:
        return bool(sympy.Le(self.needed, self.capacity))

    def reason(self) -> str:
        n, c = int(self.needed), int(self.capacity)
        if self.unit == "bytes":
            return f"{self.memory}: needs {n / KiB:.1f} KiB > capacity {c / KiB:.1f} KiB"
        return f"{self.memory}: needs {n} {self.unit} > capacity {c} {self.unit}"


def _threads(knobs: dict[str, Any]) -> int:
    """Threads of a CUDA CTA: the ``threads`` knob, else ``num_warps`` x 32, else 256 (assumed)."""
    if "threads" in knobs:
        return int(knobs["threads"])
    if "num_warps" in knobs:
        return 32 * int(knobs["num_warps"])
    return 256


REG_OVERHEAD = 32  # registers per thread for addresses, loop counters and the like


def _cuda_limits(u: TileUsage, knobs, tmem: bool) -> list[Limit]:
    threads = _threads(knobs)
    reg_bytes = u.peak[Role.VECTOR] + (0 if tmem else u.peak[Role.ACCUMULATOR])
    per_thread = sympy.ceiling(sympy.Integer(reg_bytes) / 4 / threads) + REG_OVERHEAD
    limits = [Limit("shared memory", sympy.Integer(u.peak[Role.OPERAND]), sympy.Integer(227 * KiB)),
              Limit("registers per thread", per_thread, sympy.Integer(255), "registers"),
              Limit("registers per SM", per_thread * threads, sympy.Integer(64 * 1024), "registers")]
    if tmem:
        # an fp32 accumulator of BM x BN takes BN columns per 128 lanes of rows
        cols = sum(s[-1] * math.ceil((math.prod(s[:-1]) or 1) / 128) for s in u.accumulators)
        limits.append(Limit("tensor memory", sympy.Integer(cols), sympy.Integer(512), "columns"))
    return limits


def sm90_limits(u: TileUsage, knobs) -> list[Limit]:
    return _cuda_limits(u, knobs, tmem=False)


def sm100_limits(u: TileUsage, knobs) -> list[Limit]:
    return _cuda_limits(u, knobs, tmem=True)


def ascend950_limits(u: TileUsage, knobs) -> list[Limit]:
    # vector work runs in SIMT/SIMD regions; with a SimtVF, 32 KiB of UB is reserved.
    ub = (216 if u.has_vector_work else 248) * KiB
    split = int(knobs.get("vector_split", knobs.get("VECTOR_SPLIT", 1)))  # rows shared by the AIVs
    return [Limit("UB", sympy.ceiling(sympy.Integer(u.peak[Role.VECTOR]) / split), sympy.Integer(ub)),
            Limit("L1", sympy.Integer(u.peak[Role.OPERAND]), sympy.Integer(512 * KiB)),
            Limit("L0A", sympy.Integer(u.gemm_a), sympy.Integer(64 * KiB)),
            Limit("L0B", sympy.Integer(u.gemm_b), sympy.Integer(64 * KiB)),
            Limit("L0C", sympy.Integer(u.peak[Role.ACCUMULATOR]), sympy.Integer(256 * KiB))]


MEMORY_MODELS: dict[str, Callable[[TileUsage, dict], list[Limit]]] = {
    "sm90": sm90_limits, "sm100": sm100_limits, "ascend950": ascend950_limits}

# (M multiple, N multiple, K multiple in bytes) of one MMA instruction
MMA_ATOMS: dict[str, tuple[int, int, int]] = {"sm90": (64, 8, 32), "sm100": (64, 16, 32), "ascend950": (16, 16, 32)}


def mma_reasons(u: TileUsage, target: str) -> list[str]:
    atom = MMA_ATOMS.get(target)
    if atom is None:
        return []
    out = []
    for op in u.gemms:
        a, b, _ = op.args
        ta, tb = op.attrs.get("transpose_a"), op.attrs.get("transpose_b")
        m, k = (a.type.shape[1], a.type.shape[0]) if ta else a.type.shape
        n = b.type.shape[0] if tb else b.type.shape[1]
        kbytes = int(k) * a.type.dtype.bits // 8
        for what, size, mult in (("M", m, atom[0]), ("N", n, atom[1]), ("K bytes", kbytes, atom[2])):
            if sympy.Mod(sympy.Integer(int(size)), mult) != 0:
                where = f" ({op.loc})" if op.loc else ""
                out.append(f"gemm {what}={int(size)} is not a multiple of the {target} MMA atom {mult}{where}")
    return out


def waste_reasons(module: Module, exempt: set[str]) -> list[str]:
    """Tiles larger than the next power of two of the dimension they walk."""
    out, seen = [], set()
    for op in module.walk():
        if op.name not in ("load", "store"):
            continue
        param = module.param(op.attrs["tensor"])
        shape = op.attrs["shape"]
        dims = param.shape[len(param.shape) - len(shape):]
        names = _dim_names(module, param.name)[len(param.shape) - len(shape):]
        for ext, size, name in zip(shape, dims, names):
            if name in exempt or not (ext.is_Integer and size.is_Integer):
                continue
            cap = 1 << max(0, int(size) - 1).bit_length()
            if int(ext) > cap and (name, int(ext)) not in seen:
                seen.add((name, int(ext)))
                out.append(f"tile extent {int(ext)} over {name}={int(size)} exceeds its power-of-two "
                           f"bucket {cap} (only masked work)")
    return out


def _dim_names(module: Module, tensor: str) -> list[str]:
    return [str(d) for d in module.param(tensor).dims]


# -- user relations --------------------------------------------------------------------------

_REL = re.compile(r"(==|!=|<=|>=|<|>)")
_OPS = {"==": sympy.Eq, "!=": sympy.Ne, "<=": sympy.Le, ">=": sympy.Ge, "<": sympy.Lt, ">": sympy.Gt}


def parse_relation(text: str) -> Callable[[dict[str, Any]], bool]:
    """``"Mod(K, BK) == 0"`` -> a predicate over {shape or parameter name: value}."""
    parts = _REL.split(text)
    if len(parts) != 3:
        raise DslError(f"constraint {text!r}: write one comparison, e.g. 'Mod(K, BK) == 0'")
    lhs, op, rhs = sympy.sympify(parts[0]), parts[1], sympy.sympify(parts[2])

    def holds(values: dict[str, Any]) -> bool:
        subs = {sympy.Symbol(k): v for k, v in values.items() if isinstance(v, (int, float))}
        rel = _OPS[op](lhs.subs(subs), rhs.subs(subs))
        if rel not in (sympy.true, sympy.false):
            missing = sorted(str(s) for s in (lhs.free_symbols | rhs.free_symbols) - set(subs))
            raise DslError(f"constraint {text!r}: no value for {', '.join(missing)}")
        return bool(rel)

    holds.text = text
    return holds


# -- the checker -----------------------------------------------------------------------------


@dataclass
class Verdict:
    ok: bool
    reasons: list[str] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)  # memory -> needed (its unit)
    module: Module | None = None


class Constraints:
    """Checks configs of one kernel, one call signature and one target."""

    def __init__(self, kernel: KernelDef, sig: Signature, target: str, constants: dict | None = None,
                 relations: list[str] = (), owners: dict[str, str] | None = None):
        self.kernel, self.sig, self.target = kernel, sig, target
        self.constants = constants
        self.relations = [parse_relation(r) for r in relations]
        self.owners = owners or {}
        self._cache: dict[tuple, Verdict] = {}

    def bound(self, config: dict[str, Any]) -> Module:
        """The traced module of a config with its shapes bound: the one trace every check reads."""
        kern = {k: v for k, v in config.items() if k in self.kernel.tunables}
        return bind_shapes(self.kernel.trace(self.sig.dtypes, self.sig.present, kern, self.constants),
                           self.sig.shapes)

    def check(self, config: dict[str, Any]) -> Verdict:
        key = tuple(sorted((k, repr(v)) for k, v in config.items()))
        if key not in self._cache:
            self._cache[key] = self._check(config)
        return self._cache[key]

    def _check(self, config: dict[str, Any]) -> Verdict:
        values = {**self.sig.shapes, **config}
        reasons = [f"violates {r.text}" for r in self.relations if not r(values)]
        try:
            bound = self.bound(config)
        except DslError as err:
            return Verdict(False, reasons + [f"does not trace: {err}"])
        # the estimator reads a fused copy; `bound` itself is left for the target's own pipeline
        module = fuse_elementwise(Rewriter().module(bound))
        usage = estimate_usage(module)
        knobs = {k: v for k, v in config.items() if k not in self.kernel.tunables}
        limits = MEMORY_MODELS.get(self.target, lambda u, k: [])(usage, knobs)
        reasons += [lim.reason() for lim in limits if not lim.ok()]
        reasons += mma_reasons(usage, self.target)
        exempt = {self.kernel.batch_dim} if self.kernel.batch_dim else set()
        reasons += waste_reasons(module, exempt)
        if not reasons:
            reasons += self._target_capacity(bound, knobs)
        return Verdict(not reasons, reasons, {lim.memory: int(lim.needed) for lim in limits}, module)

    def _target_capacity(self, bound: Module, knobs: dict[str, Any]) -> list[str]:
        """The target's own pipeline and capacity model (what its build would reject), still before
        any compiler runs: the estimator above is a quick filter, the target's check is the law.
        ``tgt.lower`` may rewrite ``bound`` in place."""
        from ...codegen.target import get_target
        from ...dsl.errors import CapacityError, UnsupportedError

        tgt = get_target(self.target)
        try:
            tgt.lower(bound, {**tgt.default_knobs(), **knobs})
        except CapacityError as err:
            return [f"{err.memory}: needs {err.needed / 1024:.1f} KiB > capacity {err.capacity / 1024:.1f} KiB "
                    f"({self.target}'s capacity model)"]
        except UnsupportedError as err:
            return [f"unsupported on {self.target}: {err}"]
        return []
