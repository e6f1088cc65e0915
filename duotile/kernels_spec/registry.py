"""What the rest of duotile needs to know about a kernel spec, in one record.

A ``Spec`` ties a DSL kernel to its PyTorch reference, a way to make inputs for a named
case, the tolerances of its outputs and the shapes it must serve in the model
(``model_shapes``, built from ``model_shapes.py``), and says which of its sizes a random test
may vary and how far (``sweep``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..dsl import KernelDef

Case = dict[str, Any]

def _is_prime(n: int) -> bool:
    return n > 1 and all(n % p for p in range(2, int(n ** 0.5) + 1))


@dataclass(frozen=True)
class Dim:
    """A size a random case may take: ``lo .. hi`` (inclusive) in steps of ``multiple``;
    ``large`` raises ``hi`` for a large draw (on a GPU, where sizes cost little). A draw is a
    bound, a power of two, a prime (where ``multiple`` is 1) or any value in range, so that sweeps
    meet ragged edges, exact tiles and odd sizes alike."""

    lo: int
    hi: int
    multiple: int = 1
    large: int | None = None

    def __post_init__(self):
        if not (self.multiple >= 1 and self.lo % self.multiple == 0 and self.lo <= self.hi):
            raise ValueError(f"Dim({self.lo}, {self.hi}, multiple={self.multiple}): lo must be a multiple "
                             f"of multiple and at most hi")

    def sample(self, rng: random.Random, large: bool = False) -> int:
        hi = self.large if large and self.large else self.hi
        steps = (hi - self.lo) // self.multiple
        kind = rng.choice(("edge", "pow2", "prime", "any", "any"))
        if kind == "edge":
            return rng.choice((self.lo, self.lo + steps * self.multiple))
        if kind == "pow2":
            pows = [1 << i for i in range(31) if self.lo <= 1 << i <= hi and (1 << i) % self.multiple == 0]
            if pows:
                return rng.choice(pows)
        if kind == "prime" and self.multiple == 1:
            top = min(hi, self.lo + 4096)  # a prime near the low end too, not only large ones
            start = rng.randint(self.lo, top)
            for n in (*range(start, hi + 1), *range(start, self.lo - 1, -1)):
                if _is_prime(n):
                    return n
        return self.lo + rng.randint(0, steps) * self.multiple


@dataclass(frozen=True)
class OneOf:
    """A value a random case picks from a list (a dtype, a flag, a fixed set of widths)."""

    values: tuple

    def __init__(self, *values):
        object.__setattr__(self, "values", tuple(values))

    def sample(self, rng: random.Random, large: bool = False) -> Any:
        return rng.choice(self.values)


def draw(value: Any, rng: random.Random, large: bool = False) -> Any:
    """A sweep entry's value: a ``Dim`` / ``OneOf`` samples, a dict draws each entry, anything else
    is fixed."""
    if isinstance(value, (Dim, OneOf)):
        return value.sample(rng, large)
    if isinstance(value, dict):
        return {k: draw(v, rng, large) for k, v in value.items()}
    return value


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
    # outputs that are a function of the kernel's own other outputs (a quantised copy of ``o``):
    # name -> (case, the call's tensors) -> what it must hold, checked bit for bit where the call has it
    derived: dict[str, Callable[[Case, dict], torch.Tensor]] = field(default_factory=dict)
    flops: Callable[[Case], float] | None = None
    bytes_moved: Callable[[Case], float] | None = None
    # the shapes the models need, "<model>/<what>/<phase>" -> case (sizes, dtype, "model" tag):
    # see model_shapes.py; the config a call gets for them is chosen (codegen/choose_config.py)
    model_shapes: dict[str, Case] = field(default_factory=dict)
    # how random cases vary: case key -> Dim / OneOf / fixed value; "config" maps tunables the
    # same way (the interpreter's sweep draws them; a GPU sweep builds with the user's config)
    sweep: dict[str, Any] = field(default_factory=dict)
    # a random case must satisfy this (e.g. a split count no larger than the blocks); redrawn else
    sweep_valid: Callable[[Case], bool] | None = None
    # leading dims the reference is independent over, run one index at a time (``run_reference``)
    reference_parts: tuple[str, ...] = ()
    # tensors that go with the batch though no dimension of theirs is named ``batch_dim`` (a key
    # stack a query, named apart so that one stack may serve every query): case -> {tensor: axis}
    batched_with: Callable[[Case], dict[str, int]] | None = None

    @property
    def name(self) -> str:
        return self.kernel.name

    def meta_inputs(self, case: Case) -> dict[str, torch.Tensor]:
        """Inputs with shapes and dtypes only (no data): enough to specialise and build."""
        with torch.device("meta"):
            return self.make_inputs(case, torch.device("meta"), 0)

    def config_of(self, case: Case, target: str | None = None) -> dict[str, Any]:
        """The tunables a test case pins (``"config"``: tile sizes or split counts it exercises).
        A spec names no target: per-target configs live in the shipped tables
        (``duotile/tuned/``), and ``target`` is accepted for callers that pass one."""
        return dict(case.get("config", {}))

    def model_cases(self, model: str | None = None) -> dict[str, Case]:
        """The model shapes of one model (its tag ``v41-flash`` or short name ``v41``), or all."""
        if model is None:
            return dict(self.model_shapes)
        from .model_shapes import model_named

        tag = model_named(model).name
        return {k: c for k, c in self.model_shapes.items() if c.get("model") == tag}

    def random_case(self, rng: random.Random, large: bool = False) -> Case:
        """A case drawn from ``sweep`` (``large``: up to each ``Dim``'s large bound)."""
        if not self.sweep:
            raise ValueError(f"kernel spec {self.name!r} declares no sweep")
        for _ in range(1000):
            case = {k: draw(v, rng, large) for k, v in self.sweep.items()}
            if self.sweep_valid is None or self.sweep_valid(case):
                return case
        raise ValueError(f"kernel spec {self.name!r}: no valid random case in 1000 draws of its sweep")

    def allowed_error(self, case: Case, output: str, want: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The largest |got - want| accepted for each element of ``output``: none where the
        reference is not finite (a masked -inf logit must be -inf, not any value a relative
        tolerance of an infinity would allow; callers accept ``got == want`` and NaN for NaN)."""
        atol, rtol = self.tolerance(case, output)
        allowed = atol + rtol * want.float().abs()
        if self.extra_error is not None:
            allowed = allowed + self.extra_error(case, output, inputs).to(allowed.device)
        return torch.where(torch.isfinite(want.float()), allowed, 0.0)

    def run_reference(self, inputs: dict[str, torch.Tensor], case: Case, whole: bool = False
                      ) -> dict[str, torch.Tensor]:
        """The reference's outputs (FP32 where run in parts). A spec whose reference holds a large
        intermediate (attention's B x H x S x S scores) names the leading dims it is independent
        over (``reference_parts``): it then runs one index of them at a time, unless ``whole``."""
        if self.reference_parts and not whole:
            return self._reference_in_parts(inputs, case)
        args = {k: v for k, v in inputs.items() if k not in self.outputs and k not in self.derived}
        return self.reference(**args, **self.constants_of(case))

    def _reference_in_parts(self, inputs, case) -> dict[str, torch.Tensor]:
        dims = self.reference_parts
        for name, t in self.kernel.tensors.items():
            assert tuple(t.dims[:len(dims)]) == dims, f"{self.name}.{name} does not lead with {dims}"
        lead = inputs[self.outputs[0]].shape[:len(dims)]
        out = {o: torch.empty(inputs[o].shape, dtype=torch.float32, device=inputs[o].device) for o in self.outputs}
        for idx in torch.cartesian_prod(*(torch.arange(n) for n in lead)).reshape(-1, len(dims)).tolist():
            part = {k: v[tuple(slice(i, i + 1) for i in idx)] for k, v in inputs.items()}
            for o, v in self.run_reference(part, case, whole=True).items():
                out[o][tuple(slice(i, i + 1) for i in idx)] = v.float()
        return out


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
    """Every spec of this package: each module registers its own on import, so a new spec is a new
    file and nothing else (the helpers beside them, such as ``ue8m0`` and ``model_shapes``,
    register nothing)."""
    import importlib
    import pkgutil

    for mod in sorted(m.name for m in pkgutil.iter_modules(_package_path())):
        importlib.import_module(f"{__package__}.{mod}")
    return REGISTRY


def _package_path() -> list[str]:
    from pathlib import Path

    return [str(Path(__file__).parent)]
