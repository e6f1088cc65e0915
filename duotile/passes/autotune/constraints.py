"""Constraints on a config, evaluated with sympy before anything is compiled.

A config is traced, its shapes bound (``bind_shapes``) and its elementwise chains fused
(``fuse_elementwise``, as the targets do), and then three kinds of rules are checked, each
written over the Tile IR, never over a kernel's name or its tunables' names:

- **capacity**: a generic estimator (``usage.py``) walks the IR, tracks which tiles are live
  at once and sums their bytes by role (operands multiplied by the stages of the pipelined
  loop that loads them); each target maps that to its own memories and register budget
  (``Target.tuning_limits``: shared memory, registers and TMEM on sm90 / sm100; UB, L1,
  L0A / L0B and L0C on ascend950) and compares with sympy. A config that passes is then put
  through the target's own ``lower`` and build-time capacity check, which has the last word.
- **instruction shapes**: every ``gemm`` tile is a multiple of the target's MMA atom
  (``Target.mma_atom``: wgmma m64 x n8 x 32 bytes of K on sm90, tcgen05 m64 x n16 on sm100,
  16 x 16 fractals on the Ascend cube).
- **divisibility / waste**: a tile extent larger than the next power of two of the tensor
  dimension it walks only computes masked elements, so it is pruned; the batch dimension of a
  batch-invariant kernel is exempt (its config must serve every batch size). Callers add their
  own relations as text, e.g. ``"Mod(K, BK) == 0"`` or ``"BM * BN <= 32768"``.

A pruned config keeps every reason.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy

from ...codegen.target import get_target
from ...dsl.errors import DslError
from ...dsl.ir import Module
from ...dsl.kernel import KernelDef, Signature
from ..bind_shapes import bind_shapes
from ..fuse_elementwise import fuse_elementwise
from ..split_phases import phase_views
from .usage import TileUsage, estimate_usage


def mma_reasons(u: TileUsage, target: str, atom: tuple[int, int, int] | None) -> list[str]:
    """Gemm tiles that are not a multiple of the target's MMA atom (M, N, K bytes)."""
    if atom is None:
        return []
    out = []
    for op in u.gemms:
        m, n, k = op.gemm_mnk()
        kbytes = int(k) * op.args[0].type.dtype.bits // 8
        for what, size, mult in (("M", m, atom[0]), ("N", n, atom[1]), ("K bytes", kbytes, atom[2])):
            if sympy.Mod(sympy.Integer(int(size)), mult) != 0:
                where = f" ({op.loc})" if op.loc else ""
                out.append(f"gemm {what}={int(size)} is not a multiple of the {target} MMA atom {mult}{where}")
    return out



VECTOR_FLOOR = 32  # a kernel without a gemm: tiles up to a warp's lanes are never waste


def waste_floor(phases: list[Module], least_tile: int) -> int:
    """The waste rule's floor for a kernel of these phases: the target's least tile where any phase
    runs a gemm (a split gemm's combine phase reads the gemm's tiles), else ``VECTOR_FLOOR``."""
    gemm = any(op.name == "gemm" for phase in phases for op in phase.walk())
    return least_tile if gemm else min(least_tile, VECTOR_FLOOR)


def waste_reasons(module: Module, exempt: set[str], floor: int = 64) -> list[str]:
    """Tiles larger than the next power of two of the dimension they walk, and larger than
    ``floor``, the target's ``least_tile``: a decode GEMM of one row still takes a 64-row tile on
    sm90 (128 on sm100, whose 64-row form takes only N multiples of 64), the least the tensor
    cores take, and refusing it would leave no candidate at all. A kernel without a gemm has no
    such least tile: its floor is ``VECTOR_FLOOR`` (``waste_floor``) (a 64-wide tile over 16 channels is three
    quarters masked work, and its masked selects are what TileLang 0.1.15 failed to lower,
    "Cannot convert type boolx8", in compressor_decode at D = 16)."""
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
            if int(ext) > max(cap, floor) and (name, int(ext)) not in seen:
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
    usage: dict[str, int] = field(default_factory=dict)  # memory -> needed (its unit), the most of any phase
    phases: list[Module] = field(default_factory=list)  # the fused module of each phase (what the model reads)
    usages: list[TileUsage] = field(default_factory=list)  # the estimated usage of each of those phases


class Constraints:
    """Checks configs of one kernel, one call signature and one target."""

    def __init__(self, kernel: KernelDef, sig: Signature, target: str, constants: dict | None = None,
                 relations: list[str] = (), owners: dict[str, str] | None = None):
        self.kernel, self.sig, self.target = kernel, sig, target
        self.constants = constants
        self.relations = [parse_relation(r) for r in relations]
        self.owners = owners or {}
        self._cache: dict[tuple, Verdict] = {}
        # by the kernel's tunables: the fused phases of the bound module and their estimated usage
        self._traced: dict[tuple, tuple[list[Module], list[TileUsage]]] = {}

    def bound(self, config: dict[str, Any]) -> Module:
        """The traced module of a config with its shapes bound: the one trace every check reads."""
        return bind_shapes(self._symbolic(config), self.sig.shapes)

    def bound_phases(self, config: dict[str, Any]) -> list[Module]:
        """``split_phases(self.bound(config))``: each phase a new module that a pass may rewrite."""
        return bind_phases(self._symbolic(config), self.sig.shapes)

    def _symbolic(self, config: dict[str, Any]) -> Module:
        kern = {k: v for k, v in config.items() if k in self.kernel.tunables}
        return _symbolic_trace(self.kernel, self.sig, kern, self.constants)

    def check(self, config: dict[str, Any], full: bool = True) -> Verdict:
        """The verdict on ``config``; ``full=False`` skips the target's own lowering and capacity
        check (the slow part), for ranking many configs before the chosen one is checked fully."""
        key = (full, tuple(sorted((k, repr(v)) for k, v in config.items())))
        if key not in self._cache:
            self._cache[key] = self._check(config, full)
        return self._cache[key]

    def _check(self, config: dict[str, Any], full: bool = True) -> Verdict:
        reasons = self._relations(config)
        try:
            phases, usages, knobs, tgt = self._trace(config)
        except DslError as err:
            return Verdict(False, reasons + [f"does not trace: {err}"])
        exempt = {self.kernel.batch_dim} if self.kernel.batch_dim else set()
        needed: dict[str, int] = {}
        floor = waste_floor(phases, tgt.least_tile)
        for phase, usage in zip(phases, usages):  # each phase is a launch of its own
            limits = tgt.tuning_limits(usage, tgt.phase_knobs(phase, {**tgt.default_knobs(), **knobs}))
            reasons += [lim.reason() for lim in limits if not lim.ok()]
            reasons += mma_reasons(usage, self.target, tgt.mma_atom)
            reasons += waste_reasons(phase, exempt, floor)
            for lim in limits:
                needed[lim.memory] = max(needed.get(lim.memory, 0), int(lim.needed))
        reasons = list(dict.fromkeys(reasons))
        if not reasons and full:
            reasons += self._target_capacity(config, knobs)
        return Verdict(not reasons, reasons, needed, phases, usages)

    def law(self, config: dict[str, Any]) -> list[str]:
        """Why a build would refuse ``config`` (empty: it would not): the user's relations, tracing,
        the MMA atom and the target's own lowering and capacity checks. The quick estimates
        (registers, waste) are left out: they filter a search, they do not forbid a build."""
        reasons = self._relations(config)
        try:
            _, usages, knobs, tgt = self._trace(config)
        except DslError as err:
            return reasons + [f"does not trace: {err}"]
        reasons += [r for usage in usages for r in mma_reasons(usage, self.target, tgt.mma_atom)]
        return reasons or self._target_capacity(config, knobs)

    def _relations(self, config: dict[str, Any]) -> list[str]:
        values = {**self.sig.shapes, **config}
        return [f"violates {r.text}" for r in self.relations if not r(values)]

    def _trace(self, config: dict[str, Any]):
        """The fused bound phases (what the estimator reads), their estimated usage, the target
        knobs and the target. All but the knobs depend on the kernel's
        tunables only, so configs that differ in target knobs alone share one trace: the config
        search tries many such neighbours. A trace error is not kept (it is raised again)."""
        kern = tuple(sorted((k, repr(v)) for k, v in config.items() if k in self.kernel.tunables))
        if kern not in self._traced:
            self._traced[kern] = _shared_trace(self, kern, config)
        knobs = {k: v for k, v in config.items() if k not in self.kernel.tunables}
        return *self._traced[kern], knobs, get_target(self.target)

    def _target_capacity(self, config: dict[str, Any], knobs: dict[str, Any]) -> list[str]:
        """The target's own pipeline and capacity model (what its build would reject), still before
        any compiler runs: the estimator above is a quick filter, the target's check is the law.
        ``tgt.lower`` may rewrite a module in place, so it gets phases bound anew."""
        from ...dsl.errors import CapacityError, UnsupportedError

        tgt = get_target(self.target)
        try:
            for phase in self.bound_phases(config):
                tgt.lower(phase, tgt.phase_knobs(phase, {**tgt.default_knobs(), **knobs}))
        except CapacityError as err:
            return [f"{err.memory}: needs {err.needed / 1024:.1f} KiB > capacity {err.capacity / 1024:.1f} KiB "
                    f"({self.target}'s capacity model)"]
        except UnsupportedError as err:
            return [f"unsupported on {self.target}: {err}"]
        return []


# Traces kept for every Constraints of the process, each beside its kernel (an id is not reused while
# the kernel lives). Nothing changes a kept trace: bind_shapes writes a new module, the checks lower
# phases bound anew.
_TRACES_MAX = 1024
# symbolic traces (shapes not yet bound) by call and tile config: a trace does not depend on the
# sizes, so the config searches of every shape of a spec share them (a model's 30 GEMM shapes, each
# searching the same tiles)
_SYMBOLIC: dict[tuple, tuple] = {}
# the fused phases of bound traces and their usage, by call, shapes and tile config: the trace does not
# depend on the target, so a shape's config searches on sm90, sm100 and ascend950 (and a dynamic
# batch's sizes, and a tuning sweep after the choice of a default) share them
_TRACES: dict[tuple, tuple] = {}


def bind_phases(module: Module, shapes: dict[str, int]) -> list[Module]:
    """``split_phases(bind_shapes(module, shapes))`` with one copy instead of two: each phase of
    the unbound ``module`` is bound on its own (``bind_shapes`` writes a new module), then named as
    ``split_phases`` names it. ``module`` is untouched."""
    if len(module.body.ops) == 1:
        return [bind_shapes(module, shapes)]
    return [dataclasses.replace(bind_shapes(view, shapes), name=f"{module.name}_p{i}", phase=i)
            for i, view in enumerate(phase_views(module))]


def _call_key(kernel: KernelDef, sig: Signature, constants: dict | None, kern) -> tuple:
    """What a trace depends on besides the sizes: the kernel, dtypes, present tensors, constants, tiles."""
    return (id(kernel), tuple(sorted((k, v.name) for k, v in sig.dtypes.items())), tuple(sorted(sig.present.items())),
            tuple(sorted((k, repr(v)) for k, v in (constants or {}).items())), kern)


def _kept(store: dict, key: tuple, kernel: KernelDef, make: Callable[[], tuple]) -> tuple:
    """``store[key]`` (without the kernel kept beside it), made by ``make`` when missing."""
    hit = store.get(key)
    if hit is None or hit[0] is not kernel:
        if len(store) >= _TRACES_MAX:
            store.clear()
        hit = store[key] = (kernel, *make())
    return hit[1:]


def _symbolic_trace(kernel: KernelDef, sig: Signature, kern: dict[str, Any], constants: dict | None) -> Module:
    tiles = tuple(sorted((k, repr(v)) for k, v in kern.items()))
    return _kept(_SYMBOLIC, _call_key(kernel, sig, constants, tiles), kernel,
                 lambda: (kernel.trace(sig.dtypes, sig.present, kern, constants),))[0]


def _shared_trace(cons: Constraints, kern: tuple, config: dict[str, Any]):
    def make():
        phases = [fuse_elementwise(p) for p in cons.bound_phases(config)]
        return phases, [estimate_usage(p) for p in phases]

    key = (*_call_key(cons.kernel, cons.sig, cons.constants, kern), tuple(sorted(cons.sig.shapes.items())))
    return _kept(_TRACES, key, cons.kernel, make)
