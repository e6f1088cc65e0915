"""Build or run one kernel spec case on one target: what the CLI, tests and benchmarks share."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..dsl.errors import CapacityError, UnsupportedError
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
    unsupported: bool = False  # the target does not lower an op of the kernel, and says which (UnsupportedError)

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


def build_case(spec: Spec, case_name: str, case: Case, target: str, config: dict[str, Any] | None = None,
               use_cache: bool = True, use_tuned: bool = True) -> BuildResult:
    """Build one case. A ``config`` given is used over the case's own config and the defaults;
    without one, the chosen config (``choose_config``: the user's tuning cache, the shipped
    tables, the target's choice) goes over the case's config."""
    t0 = time.perf_counter()
    try:
        tgt = get_target(target)
        phases, knobs, source, skipped = _specialize(spec, case, target, config, use_tuned)
        artifacts = build_phases(spec.kernel, phases, tgt, knobs, use_cache=use_cache)
        for a in artifacts:
            a.meta["config_source"] = source
            if skipped:
                a.meta["tuned_skipped"] = skipped
        return BuildResult(spec.name, case_name, target, True, time.perf_counter() - t0, artifacts, phases)
    except Exception as err:  # reported per row; the build goes on
        msg = f"{type(err).__name__}: {err}"
        return BuildResult(spec.name, case_name, target, False, time.perf_counter() - t0, error=msg,
                           rejected=isinstance(err, CapacityError),
                           unsupported=type(err) is UnsupportedError)


def generate_case(spec: Spec, case: Case, target: str, config: dict[str, Any] | None = None,
                  use_tuned: bool = True) -> list[Artifact]:
    """The generated stages of one case (Tile IR, the target's source), one per phase, without
    compiling them: what ``duotile show`` prints even where the toolchain then fails on them."""
    tgt = get_target(target)
    phases, knobs, _, _ = _specialize(spec, case, target, config, use_tuned)
    return [tgt.generate(m, tgt.phase_knobs(m, knobs)) for m in phases]


def _specialize(spec: Spec, case: Case, target: str, config: dict[str, Any] | None, use_tuned: bool):
    """(phases, knobs, where the config came from, the cached entries skipped) under the
    precedence ``build_case`` states. A skipped entry falls back to the next choice."""
    from .choose_config import explain_choice

    sig = spec.kernel.bind(spec.meta_inputs(case))
    # a config given is the whole choice (over the case's and the defaults), as in codegen.compile
    chosen, source, skipped = (explain_choice(spec.kernel, target, sig, spec.constants_of(case))
                               if use_tuned and not config else (None, "default", []))
    for msg in skipped:
        warnings.warn(msg, stacklevel=3)
    cfg = {**spec.config_of(case, target), **(chosen or {}), **(config or {})}
    if config:
        source = "given"
    phases, knobs = specialize_phases(spec.kernel, sig, get_target(target), cfg, spec.constants_of(case))
    return phases, knobs, source, skipped
