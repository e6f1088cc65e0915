"""Build or run one kernel spec case on one target: what the CLI, tests and benchmarks share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

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

    @property
    def lines(self) -> int:
        if self.artifact is None:
            return 0
        text = self.artifact.stages.get("tilelang", "")
        return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def build_case(spec: Spec, case_name: str, case: Case, target: str, config: dict[str, Any] | None = None,
               use_cache: bool = True) -> BuildResult:
    t0 = time.perf_counter()
    try:
        tgt = get_target(target)
        sig = spec.kernel.bind(spec.meta_inputs(case))
        cfg = {**spec.config_of(case), **(config or {})}
        module, knobs = specialize(spec.kernel, sig, tgt, cfg, spec.constants_of(case))
        artifact = build_module(spec.kernel, module, tgt, knobs, use_cache=use_cache)
        return BuildResult(spec.name, case_name, target, True, time.perf_counter() - t0, artifact, module)
    except Exception as err:  # reported per row; the build goes on
        msg = f"{type(err).__name__}: {err}"
        return BuildResult(spec.name, case_name, target, False, time.perf_counter() - t0, error=msg)
