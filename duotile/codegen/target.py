"""What a target is, and the registry of targets. Shared code never switches on a target name:
it asks the registry for the target's object and calls its methods."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any

from ..dsl.errors import LoweringError, SourceLoc
from ..dsl.ir import Module
from ..dsl.tunables import Space

# name -> module that registers it when imported (so TileLang loads only when needed)
_PROVIDERS = {
    "interpret": "duotile.codegen.interpret.target",
    "sm90": "duotile.codegen.tilelang_cuda.target",
    "sm100": "duotile.codegen.tilelang_cuda.target",
    "ascend950": "duotile.codegen.tilelang_ascend.target",
}
_TARGETS: dict[str, Target] = {}
# Every target knob's name. A config may carry knobs of several targets (a spec case pins
# `threads` for CUDA and `cores` for Ascend); each target takes its own and ignores the rest.
KNOB_NAMES = frozenset({"threads", "raster", "fp8_promote_k", "overlap", "warp_specialize", "cores",
                        "vector_split", "persistent", "ftz", "full_row", "cluster",
                        "tma_store", "gather_pipeline"})


@dataclass
class Artifact:
    """Everything one build of one kernel for one target produced, by stage name."""

    kernel: str
    target: str
    stages: dict[str, str] = field(default_factory=dict)  # stage -> text (ir, tilelang, cuda, ptx, sass, ascend)
    files: dict[str, str] = field(default_factory=dict)  # stage -> path on disk (cubin, ...)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def config(self) -> dict[str, Any]:
        """The config it was built with: tunables and knobs, as ``build_module`` records them."""
        return {**self.meta.get("config", {}), **self.meta.get("knobs", {})}


class Target:
    """A code generator. Subclasses fill in the hooks; ``runnable`` says if it can execute here."""

    name: str = ""
    stages: tuple[str, ...] = ("ir",)
    knobs: dict[str, Space] = {}  # target-specific tunables (threads, cores, ...)
    dynamic_shapes: bool = True  # keeps a kernel's dynamic sizes symbolic (else builds each size)
    # a tile extent this small is never waste, however small the dimension it walks: the least
    # tile every matrix instruction of the target takes (the autotuner's waste rule)
    least_tile: int = 64

    @staticmethod
    def static_under(config: dict[str, Any]) -> bool:
        """Whether this config needs every size static on this target (it cannot serve a dynamic one)."""
        return False

    def lower(self, module: Module, knobs: dict[str, Any]) -> Module:
        """The target's pass pipeline on a bound module."""
        return module

    def generate(self, module: Module, knobs: dict[str, Any]) -> Artifact:
        raise NotImplementedError

    def build(self, artifact: Artifact, workdir: str) -> Artifact:
        """Compile generated source (nvcc, TileLang lowering); fills more stages."""
        return artifact

    def load(self, artifact: Artifact, module: Module):
        """A callable ``f(tensors: dict)`` that runs the kernel, where this machine can."""
        raise NotImplementedError(f"target {self.name} cannot run kernels on this machine")

    def prepare_load(self, artifact: Artifact) -> bool:
        """Do ahead, on any machine, what ``load`` would do first on the one that runs the kernel
        (a JIT compile into a cache it reads), so a prebuild can spare the run that time. Whether
        there was anything to do."""
        return False

    def toolchain(self) -> dict[str, str]:
        """Versions that change what this target generates (part of every cache key)."""
        return {}

    def knobs_for(self, module: Module) -> dict[str, Space]:
        """The knobs that can change this kernel's code (the autotuner searches only these)."""
        return self.knobs

    def phase_knobs(self, module: Module, knobs: dict[str, Any]) -> dict[str, Any]:
        """The knobs one phase of a multi-phase kernel builds with: a config names one value per
        knob for the whole kernel, and a phase the knob cannot apply to (a schedule for a
        pipelined loop, in a phase without one) takes the target's default instead."""
        return knobs

    def start_points(self, module: Module) -> list[dict[str, Any]]:
        """Partial configs the autotuner measures right after the default (with the user's
        ``also_try``): schedules several knob steps away that a short search would not reach."""
        return []

    def fitted_knobs(self, phases: list[Module], programs: int | None) -> list[dict[str, Any]]:
        """Knob values the target's rules prefer over its defaults for these bound phases, best
        first: the model's choice of a config tries each in turn before the defaults (a CUDA
        block sized to its tiles, ``tilelang_cuda/fit_threads.py``). ``programs``: the most
        programs a launch runs where the build's sizes are fixed, None where a dynamic size
        leaves it open. None by default."""
        return []

    def default_knobs(self) -> dict[str, Any]:
        return {k: s.default for k, s in self.knobs.items()}

    # what the autotuner asks of a target (passes/autotune/)
    mma_atom: tuple[int, int, int] | None = None  # (M, N, K bytes) one MMA instruction covers
    modelled: bool = False  # no hardware for it in this project: tuning ranks by the cost model
    runs_on: str = "cpu"  # the torch device type its kernels take tensors on
    machine = None  # the cost model's roofline figures (a cost_model.Machine) where modelled

    def tuning_limits(self, usage, knobs: dict[str, Any]) -> list:
        """``Limit``s of a config's estimated ``TileUsage``: its memories and register budget."""
        return []


def lowering_error(target: str, toolchain: str, artifact: Artifact, cause: Exception) -> LoweringError:
    """The error for a toolchain that failed on ``artifact``'s generated code: it names the kernel and
    the config it was built with (tunables and knobs, as ``build_module`` records them), and the
    spec line where the toolchain's message names a buffer of the generated source."""
    found = spec_line(artifact.stages.get("tilelang", ""), str(cause))
    loc, buffer = found if found else (None, "")
    return LoweringError(target, toolchain, artifact.kernel, artifact.config, cause, loc, buffer)


_DECLARED = re.compile(r"^\s*(\w+) = T\.alloc_\w+\(", re.MULTILINE)
_SPEC_TAG = re.compile(r"  # ([\w.\-]+\.py):(\d+)$")  # what generated statements end with


def tensor_line(source: str, tensor: str) -> SourceLoc | None:
    """The spec line of the first statement of the generated ``source`` that indexes ``tensor``."""
    uses = re.compile(rf"\b{re.escape(tensor)}\[")
    for line in source.splitlines():
        if uses.search(line) and (m := _SPEC_TAG.search(line)):
            return SourceLoc(m[1], int(m[2]))
    return None


def spec_line(source: str, message: str) -> tuple[SourceLoc, str] | None:
    """(spec line, buffer) for the first buffer of the generated ``source`` that a toolchain's
    ``message`` names (TileLang names the buffer in its layout conflicts): the spec line of the
    first statement that uses it, or of its declaration where only that carries one."""
    declared = set(_DECLARED.findall(source))
    buffer = next((w for w in re.findall(r"\w+", message) if w in declared), None)
    if buffer is None:
        return None
    uses = re.compile(rf"\b{re.escape(buffer)}\b")
    tagged = [(bool(_DECLARED.match(line)), m) for line in source.splitlines()
              if uses.search(line) and (m := _SPEC_TAG.search(line))]
    if not tagged:
        return None
    _, m = min(tagged, key=lambda t: t[0])  # a statement before a declaration, in source order
    return SourceLoc(m[1], int(m[2])), buffer


def register_target(target: Target) -> Target:
    unknown = set(target.knobs) - KNOB_NAMES
    if unknown:
        raise ValueError(f"target {target.name} declares knobs {sorted(unknown)} missing from KNOB_NAMES")
    _TARGETS[target.name] = target
    return target


def get_target(name: str) -> Target:
    if name not in _TARGETS:
        provider = _PROVIDERS.get(name)
        if provider is None:
            raise KeyError(f"unknown target {name!r}; known: {', '.join(target_names())}")
        importlib.import_module(provider)
    return _TARGETS[name]


def target_names() -> list[str]:
    return list(_PROVIDERS)
