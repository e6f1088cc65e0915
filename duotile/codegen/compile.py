"""From a kernel definition and a call to a runnable kernel: trace, bind, lower, generate, build."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..dsl.errors import DslError
from ..dsl.ir import Module
from ..dsl.kernel import KernelDef, Signature
from ..passes.bind_shapes import bind_shapes
from ..passes.check_batch_invariance import check_batch_invariance
from ..passes.verify_ir import verify_ir
from .target import KNOB_NAMES, Artifact, Target, get_target


def split_config(kernel: KernelDef, target: Target, config: dict[str, Any] | None):
    """Separate a config into the kernel's tunables and the target's knobs."""
    config = dict(config or {})
    knobs = target.default_knobs()
    for k in list(config):
        if k in target.knobs:
            knobs[k] = config.pop(k)
        elif k in KNOB_NAMES and k not in kernel.tunables:
            config.pop(k)  # another target's knob
    return kernel.resolve_config(config), knobs


def specialize(kernel: KernelDef, sig: Signature, target: str | Target = "interpret",
               config: dict[str, Any] | None = None, constants: dict[str, Any] | None = None
               ) -> tuple[Module, dict[str, Any]]:
    """Trace ``kernel`` for one call signature and run the target's pipeline on it."""
    tgt = get_target(target) if isinstance(target, str) else target
    cfg, knobs = split_config(kernel, tgt, config)
    # traces the kernel; for a decode-path kernel (batch_dim) it also rejects batch-dependent reductions
    module = verify_ir(check_batch_invariance(kernel, sig.dtypes, sig.present, constants, cfg))
    module = verify_ir(bind_shapes(module, sig.shapes))
    return verify_ir(tgt.lower(module, knobs)), knobs


@dataclass
class CompiledKernel:
    """A kernel bound to a target and a config; call it with tensors by parameter name."""

    kernel: KernelDef
    target: str = "interpret"
    config: dict[str, Any] | None = None
    constants: dict[str, Any] | None = None
    workdir: str | None = None
    _cache: dict[tuple, tuple] = field(default_factory=dict, repr=False)

    def artifact(self, **tensors) -> Artifact:
        return self._prepare(tensors)[1]

    def _prepare(self, tensors: dict):
        sig = self.kernel.bind(tensors)
        key = sig.key()
        if key not in self._cache:
            from .build import build_module

            tgt = get_target(self.target)
            config = self.config
            if config is None:  # no config given: a tuned one from `duotile tune`, if any
                from ..passes.autotune.cache import best_config

                config = best_config(self.kernel, self.target, sig.shapes, dtypes=sig.dtypes, present=sig.present,
                                     constants=self.constants)
            module, knobs = specialize(self.kernel, sig, tgt, config, self.constants)
            artifact = build_module(self.kernel, module, tgt, knobs, self.workdir)
            self._cache[key] = (module, artifact, None)
        module, artifact, fn = self._cache[key]
        return module, artifact, fn, key

    def __call__(self, **tensors):
        unknown = set(tensors) - set(self.kernel.tensors)
        if unknown:
            raise DslError(f"{self.kernel.name}: unknown argument(s) {', '.join(sorted(unknown))}")
        module, artifact, fn, key = self._prepare(tensors)
        if fn is None:
            fn = get_target(self.target).load(artifact, module)
            self._cache[key] = (module, artifact, fn)
        fn(tensors)


def compile(kernel: KernelDef, target: str = "interpret", config: dict[str, Any] | None = None,
            constants: dict[str, Any] | None = None, workdir: str | None = None) -> CompiledKernel:  # noqa: A001
    get_target(target)  # fail early on an unknown target
    return CompiledKernel(kernel, target, config, constants, workdir)
