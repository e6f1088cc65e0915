"""Build or run one kernel spec case on one target: what the CLI, tests and benchmarks share."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..dsl.errors import CapacityError
from ..dsl.ir import Module
from ..kernels_spec.registry import Case, Spec
from .compile import build_phases, specialize_phases
from .target import Artifact, get_target


@dataclass
class BuildResult:
    spec: str
    case: str
    target: str
    ok: bool
    seconds: float
    artifacts: list[Artifact] = field(default_factory=list)  # one per phase
    modules: list[Module] = field(default_factory=list)
    error: str = ""
    rejected: bool = False  # the config does not fit the target's memories (a CapacityError)

    @property
    def artifact(self) -> Artifact | None:
        """The first phase's build (the only one for most kernels)."""
        return self.artifacts[0] if self.artifacts else None

    @property
    def module(self) -> Module | None:
        return self.modules[0] if self.modules else None

    @property
    def lines(self) -> int:
        text = "\n".join(a.stages.get("tilelang", "") for a in self.artifacts)
        return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def tuned_config(spec: Spec, sig, target: str, constants: dict) -> dict[str, Any] | None:
    """The autotuner's best config for this call, when the tuning cache has one that today's
    kernel and target accept (an entry they refuse is skipped with a warning)."""
    from ..passes.autotune.cache import best_config

    return best_config(spec.kernel, target, sig.shapes, dtypes=sig.dtypes, present=sig.present, constants=constants)


def _tuned(spec: Spec, sig, target: str, constants: dict) -> tuple[dict[str, Any] | None, list[str]]:
    """``tuned_config`` and the lines saying which cached entries were skipped and why."""
    from ..passes.autotune.cache import lookup

    config, skipped = lookup(spec.kernel, target, sig.shapes, dtypes=sig.dtypes, present=sig.present,
                             constants=constants)
    for msg in skipped:
        warnings.warn(msg, stacklevel=3)
    return config, skipped


def build_case(spec: Spec, case_name: str, case: Case, target: str, config: dict[str, Any] | None = None,
               use_cache: bool = True, use_tuned: bool = True) -> BuildResult:
    """Build one case. Config precedence: ``config`` > a tuned config from the tuning cache > the
    case's own config > the kernel's defaults. A tuned config was verified and fits the target, so
    it may replace a case's starting point (which exists to fit or to start well)."""
    t0 = time.perf_counter()
    try:
        tgt = get_target(target)
        phases, knobs, tuned, skipped = _specialize(spec, case, target, config, use_tuned)
        artifacts = build_phases(spec.kernel, phases, tgt, knobs, use_cache=use_cache)
        for a in artifacts:
            a.meta["config_source"] = "tuned" if tuned else "default"
            if skipped:
                a.meta["tuned_skipped"] = skipped
        return BuildResult(spec.name, case_name, target, True, time.perf_counter() - t0, artifacts, phases)
    except Exception as err:  # reported per row; the build goes on
        msg = f"{type(err).__name__}: {err}"
        return BuildResult(spec.name, case_name, target, False, time.perf_counter() - t0, error=msg,
                           rejected=isinstance(err, CapacityError))


def generate_case(spec: Spec, case: Case, target: str, config: dict[str, Any] | None = None,
                  use_tuned: bool = True) -> list[Artifact]:
    """The generated stages of one case (Tile IR, the target's source), one per phase, without
    compiling them: what ``duotile show`` prints even where the toolchain then fails on them."""
    tgt = get_target(target)
    phases, knobs, _, _ = _specialize(spec, case, target, config, use_tuned)
    return [tgt.generate(m, tgt.phase_knobs(m, knobs)) for m in phases]


def _specialize(spec: Spec, case: Case, target: str, config: dict[str, Any] | None, use_tuned: bool):
    """(phases, knobs, the tuned config or None, the tuned entries skipped) under the precedence
    ``build_case`` states. A skipped entry falls back to the next choice: the shipped table after
    the user's cache, then the case's own config."""
    sig = spec.kernel.bind(spec.meta_inputs(case))
    tuned, skipped = _tuned(spec, sig, target, spec.constants_of(case)) if use_tuned else (None, [])
    cfg = {**spec.config_of(case, target), **(tuned or {}), **(config or {})}
    phases, knobs = specialize_phases(spec.kernel, sig, get_target(target), cfg, spec.constants_of(case))
    return phases, knobs, tuned, skipped
