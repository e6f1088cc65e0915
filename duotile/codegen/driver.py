"""Build or run one kernel spec case on one target: what the CLI, tests and benchmarks share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..dsl.errors import CapacityError
from ..dsl.ir import Module
from ..kernels_spec.registry import Case, Spec
from .build import build_module
from .compile import specialize
from .target import Artifact, get_target


@dataclass
class BuildResult:
    spec: str
    case: str
    target: str
    ok: bool
    seconds: float
    artifact: Artifact | None = None
    module: Module | None = None
    error: str = ""
    rejected: bool = False  # the config does not fit the target's memories (a CapacityError)

    @property
    def lines(self) -> int:
        if self.artifact is None:
            return 0
        text = self.artifact.stages.get("tilelang", "")
        return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def tuned_config(spec: Spec, sig, target: str, constants: dict) -> dict[str, Any] | None:
    """The autotuner's best config for this call, when the tuning cache has one."""
    from ..passes.autotune.cache import best_config

    return best_config(spec.kernel, target, sig.shapes, dtypes=sig.dtypes, present=sig.present, constants=constants)


def build_case(spec: Spec, case_name: str, case: Case, target: str, config: dict[str, Any] | None = None,
               use_cache: bool = True, use_tuned: bool = True) -> BuildResult:
    """Build one case. Config precedence: ``config`` > a tuned config from the tuning cache > the
    case's own config > the kernel's defaults. A tuned config was verified and fits the target, so
    it may replace a case's starting point (which exists to fit or to start well)."""
    t0 = time.perf_counter()
    try:
        tgt = get_target(target)
        sig = spec.kernel.bind(spec.meta_inputs(case))
        tuned = tuned_config(spec, sig, target, spec.constants_of(case)) if use_tuned else None
        cfg = {**spec.config_of(case, target), **(tuned or {}), **(config or {})}
        module, knobs = specialize(spec.kernel, sig, tgt, cfg, spec.constants_of(case))
        artifact = build_module(spec.kernel, module, tgt, knobs, use_cache=use_cache)
        artifact.meta["config_source"] = "tuned" if tuned else "default"
        return BuildResult(spec.name, case_name, target, True, time.perf_counter() - t0, artifact, module)
    except Exception as err:  # reported per row; the build goes on
        msg = f"{type(err).__name__}: {err}"
        return BuildResult(spec.name, case_name, target, False, time.perf_counter() - t0, error=msg,
                           rejected=isinstance(err, CapacityError))
