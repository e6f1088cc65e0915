"""What the rest of duotile needs to know about a kernel spec, in one record.

A ``Spec`` ties a DSL kernel to its PyTorch reference, a way to make inputs for a named
case, the tolerances of its outputs and the shapes it must serve in the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dsl import KernelDef

Case = dict[str, Any]


@dataclass
class Spec:
    kernel: KernelDef
    reference: Callable[..., dict[str, torch.Tensor]]  # inputs -> {output name: tensor}
    make_inputs: Callable[[Case, torch.device, int], dict[str, torch.Tensor]]  # with outputs allocated
    outputs: tuple[str, ...]
    cases: dict[str, Case]  # small test cases (interpreter, GPU tests)
    build_cases: dict[str, Case]  # what `duotile build` compiles: model-sized shapes (+ optional "config")
    tolerance: Callable[[Case, str], tuple[float, float]]  # (atol, rtol) for an output
    exact: bool = False  # outputs must match bit for bit
    constants_of: Callable[[Case], dict[str, Any]] = field(default=lambda case: {})  # kernel constants; the
    # reference takes them under the same names
    # an elementwise error bound beyond (atol, rtol), e.g. fp8 accumulation: (case, output, inputs) -> tensor
    extra_error: Callable[[Case, str, dict], torch.Tensor] | None = None
    flops: Callable[[Case], float] | None = None
    bytes_moved: Callable[[Case], float] | None = None

    @property
    def name(self) -> str:
        return self.kernel.name

    def meta_inputs(self, case: Case) -> dict[str, torch.Tensor]:
        """Inputs with shapes and dtypes only (no data): enough to specialise and build."""
        with torch.device("meta"):
            return self.make_inputs(case, torch.device("meta"), 0)

    def config_of(self, case: Case, target: str | None = None) -> dict[str, Any]:
        """A case may pin a config (tunables and target knobs), e.g. to fit a large head dim, and
        a per-target one on top (``"config_for": {"ascend950": {...}}``) where memories differ."""
        return {**case.get("config", {}), **case.get("config_for", {}).get(target, {})}

    def allowed_error(self, case: Case, output: str, want: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The largest |got - want| accepted for each element of ``output``."""
        atol, rtol = self.tolerance(case, output)
        allowed = atol + rtol * want.float().abs()
        if self.extra_error is not None:
            allowed = allowed + self.extra_error(case, output, inputs).to(allowed.device)
        return allowed

    def run_reference(self, inputs: dict[str, torch.Tensor], case: Case) -> dict[str, torch.Tensor]:
        args = {k: v for k, v in inputs.items() if k not in self.outputs}
        return self.reference(**args, **self.constants_of(case))


REGISTRY: dict[str, Spec] = {}


def register(spec: Spec) -> Spec:
    if spec.name in REGISTRY:
        raise ValueError(f"kernel spec {spec.name!r} registered twice")
    REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> Spec:
    load_all()
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel named {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


def load_all() -> dict[str, Spec]:
    from . import flash_attention, gather_rows, gemm, gemm_splitk, mqa_decode, rmsnorm  # noqa: F401  (they register)

    return REGISTRY
