"""From a kernel definition and a call to a runnable kernel: trace, bind, lower, generate, build."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..dsl.errors import DslError
from ..dsl.ir import Module
from ..dsl.kernel import KernelDef, Signature, bucket
from ..dsl.tunables import ConfigValueError, same_value
from ..passes.bind_shapes import bind_shapes, check_dynamic_requires
from ..passes.check_batch_invariance import check_batch_invariance
from ..passes.split_phases import split_phases
from ..passes.verify_ir import verify_ir
from .padding import check_reads_only, pad_call
from .target import KNOB_NAMES, Artifact, Target, get_target


def split_config(kernel: KernelDef, target: Target, config: dict[str, Any] | None):
    """Separate a config into the kernel's tunables and the target's knobs, refusing a name or a
    value neither declares (``check_config``)."""
    config = dict(config or {})
    check_config(kernel, target, config)
    knobs = target.default_knobs()
    for k in list(config):
        if k in target.knobs:
            knobs[k] = config.pop(k)
        elif k in KNOB_NAMES and k not in kernel.tunables:
            config.pop(k)  # another target's knob
    return kernel.resolve_config(config), knobs


def check_config(kernel: KernelDef, target: Target, config: dict[str, Any]) -> None:
    """A ``ConfigValueError`` for the first name that is neither a tunable of ``kernel`` nor a knob
    of any target, or the first value its tunable or ``target``'s knob does not accept (the message
    lists the allowed values). Another target's knobs pass through unjudged: a spec case pins
    ``cores`` for Ascend beside ``threads`` for CUDA, and each target takes its own."""
    where = f"{kernel.name} on {target.name}: "
    for name, value in config.items():
        if name in kernel.tunables:
            space = kernel.tunables[name]
            if space.accepts(value):
                continue
            pinned = [v for v in spec_pinned(kernel).get(name, ()) if not space.accepts(v)]
            if any(same_value(v, value) for v in pinned):
                continue
            extra = f", or as the spec's cases pin it: {sorted(set(pinned), key=repr)}" if pinned else ""
            raise ConfigValueError(f"{where}{name}={value!r} is not allowed: {name} takes {space.allowed()}{extra}")
        elif name in target.knobs:
            target.knobs[name].check(name, value, where)
        elif name not in KNOB_NAMES:
            knobs = ", ".join(target.knobs) or "none"
            raise ConfigValueError(f"{where}kernel {kernel.name!r} has no tunable {name!r} and no target has a "
                                   f"knob of that name; tunables: {', '.join(kernel.tunables) or 'none'}; "
                                   f"{target.name} knobs: {knobs}")


def spec_pinned(kernel: KernelDef) -> dict[str, list]:
    """Values the kernel's own spec pins for its tunables in a case (``config``):
    the spec file declares them beside the kernel, so a build accepts them although the search
    never proposes them (small test shapes pin tiles smaller than any searched one)."""
    from ..kernels_spec.registry import REGISTRY

    spec = REGISTRY.get(kernel.name)
    if spec is None or spec.kernel is not kernel:
        return {}
    out: dict[str, list] = {}
    for case in (*spec.cases.values(), *spec.build_cases.values()):
        for cfg in (case.get("config", {}),):
            for k, v in cfg.items():
                out.setdefault(k, []).append(v)
    return out


def specialize_phases(kernel: KernelDef, sig: Signature, target: str | Target = "interpret",
                      config: dict[str, Any] | None = None, constants: dict[str, Any] | None = None
                      ) -> tuple[list[Module], dict[str, Any]]:
    """Trace ``kernel`` for one call signature, split it into its phases (one launch each, see
    ``passes/split_phases.py``) and run the target's pipeline on each."""
    tgt = get_target(target) if isinstance(target, str) else target
    cfg, knobs = split_config(kernel, tgt, config)
    # traces the kernel; for a decode-path kernel (batch_dim) it also rejects batch-dependent reductions
    module = verify_ir(check_batch_invariance(kernel, sig.dtypes, sig.present, constants, cfg))
    if not tgt.dynamic_shapes or tgt.static_under(config or {}):
        sig = sig.with_static(sig.dynamic)  # this target, or this config, builds every size on its own
    module = verify_ir(bind_shapes(module, sig.shapes, sig.dynamic))
    return [verify_ir(tgt.lower(p, tgt.phase_knobs(p, knobs))) for p in split_phases(module)], knobs


def specialize(kernel: KernelDef, sig: Signature, target: str | Target = "interpret",
               config: dict[str, Any] | None = None, constants: dict[str, Any] | None = None
               ) -> tuple[Module, dict[str, Any]]:
    """``specialize_phases`` for a kernel of one phase: its module and knobs."""
    phases, knobs = specialize_phases(kernel, sig, target, config, constants)
    if len(phases) != 1:
        raise DslError(f"{kernel.name} runs in {len(phases)} phases; use specialize_phases", kernel.loc)
    return phases[0], knobs


def build_phases(kernel: KernelDef, phases: list[Module], target: Target, knobs: dict[str, Any],
                 workdir: str | None = None, use_cache: bool = True) -> list[Artifact]:
    """One artifact per phase (each cached on its own; in ``workdir/p<i>`` where there are several)."""
    from .build import build_module

    def where(i: int) -> str | None:
        return workdir if workdir is None or len(phases) == 1 else f"{workdir}/p{i}"

    return [build_module(kernel, m, target, target.phase_knobs(m, knobs), where(i), use_cache=use_cache)
            for i, m in enumerate(phases)]


class PhasedCall:
    """The loaded phases of one build, called in order with the same tensors; each workspace is
    allocated once per call signature (on the first tensor's device) and reused.

    A workspace outgrown by a larger call is replaced, never freed: a CUDA graph captured with a
    kernel call (``runtime/graphs.py``) holds the workspace's address, and a freed one would be
    handed to other tensors while the graph still writes and reads it. The replaced ones are kept
    in ``retired``; new ones are sized to a power of two, so that a growing size replaces a
    workspace a logarithmic number of times."""

    def __init__(self, phases: list[Module], fns: list):
        self.phases, self.fns = phases, fns
        self.workspaces: dict[str, Any] | None = None
        self.retired: list[dict[str, Any]] = []  # outgrown workspaces, kept alive (class docstring)
        self._shapes: dict[tuple, dict[str, tuple[int, ...]]] = {}  # workspace shapes by dynamic sizes
        self._views: dict[tuple, dict[str, Any]] = {}  # views of the current workspaces by sizes and device
        self._ws = phases[0].workspaces  # a property that walks the params: read once
        self._places = phases[0].dynamic_places() if self._ws else ()  # where the call's sizes are read
        # the device the workspaces go on: a tensor every call gives, where the kernel has one
        self._on = next((p.name for p in phases[0].params if not p.optional and not p.workspace), None)

    def _workspace_shapes(self, sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """Each workspace's shape at these dynamic sizes (sympy once per distinct sizes, not per call)."""
        key = tuple(sorted(sizes.items()))
        if key not in self._shapes:
            first = self.phases[0]
            self._shapes[key] = {p.name: first.workspace_shape(p, sizes) for p in first.workspaces}
        return self._shapes[key]

    def __call__(self, tensors: dict) -> None:
        args = tensors
        if self._ws:  # sized at the call's dynamic sizes; reused while they fit
            sizes = self.phases[0].dynamic_sizes(tensors, self._places)
            device = (tensors[self._on] if self._on in tensors else
                      next(t for t in tensors.values() if t is not None and hasattr(t, "device"))).device
            key = (tuple(sizes.items()), device)
            views = self._views.get(key)
            if views is None:  # slicing and viewing cost a few us a call: once per sizes and device
                views = self._views[key] = self._make_views(sizes, device)
            args = {**tensors, **views}
        for fn in self.fns:
            fn(args)

    def _make_views(self, sizes: dict[str, int], device) -> dict[str, Any]:
        import torch

        shapes = self._workspace_shapes(sizes)
        have = self.workspaces or {}
        if any(n not in have or have[n].numel() < _numel(s) or have[n].device != device for n, s in shapes.items()):
            if self.workspaces:
                self.retired.append(self.workspaces)
            self.workspaces = {p.name: torch.empty(bucket(_numel(shapes[p.name])), dtype=p.dtype.torch, device=device)
                               for p in self._ws}
            self._views.clear()  # views of the old workspaces
        return {n: self.workspaces[n][:_numel(s)].view(s) for n, s in shapes.items()}


def load_phases(target: Target, phases: list[Module], artifacts: list[Artifact]) -> PhasedCall:
    return PhasedCall(phases, [target.load(a, m) for a, m in zip(artifacts, phases)])


@dataclass
class CompiledKernel:
    """A kernel bound to a target and a config; call it with tensors by parameter name."""

    kernel: KernelDef
    target: str = "interpret"
    config: dict[str, Any] | None = None
    constants: dict[str, Any] | None = None
    workdir: str | None = None
    _cache: dict[tuple, tuple] = field(default_factory=dict, repr=False)
    _configs: dict[tuple, dict | None] = field(default_factory=dict, repr=False)  # the config chosen per build key
    _calls: dict[tuple, Any] = field(default_factory=dict, repr=False)  # loaded phases by the call's shapes and dtypes

    def artifact(self, **tensors) -> Artifact:
        """The build for these tensors (the first phase's, where the kernel has several)."""
        return self.artifacts(**tensors)[0]

    def artifacts(self, **tensors) -> list[Artifact]:
        """One build per phase."""
        return self._prepare(self._padded(tensors))[1]

    def _padded(self, tensors: dict) -> dict:
        """The call's tensors, padded along the kernel's padded sizes (``codegen/padding.py``)."""
        return pad_call(self.kernel, tensors) if self.kernel.padded else tensors

    def _prepare(self, tensors: dict):
        tgt = get_target(self.target)
        sig = self.kernel.bind(tensors)
        if not tgt.dynamic_shapes:  # this target builds each size on its own
            sig = sig.with_static(sig.dynamic)
        config = self._config(sig)
        if sig.dynamic and config and tgt.static_under(config):
            sig = sig.with_static(sig.dynamic)  # this config cannot serve a dynamic size
        key = (sig.key(), tuple(sorted((config or {}).items(), key=str)))
        if key not in self._cache:
            phases, knobs = specialize_phases(self.kernel, sig, tgt, config, self.constants)
            if self.kernel.padded:
                check_reads_only(self.kernel, phases)
            self._cache[key] = (phases, build_phases(self.kernel, phases, tgt, knobs, self.workdir), None)
        phases, artifacts, fn = self._cache[key]
        check_dynamic_requires(phases[0], sig.shapes)  # once a call shape: the build serves many
        return phases, artifacts, fn, key

    def _config(self, sig) -> dict[str, Any] | None:
        """The config of a call: the one given, else the choice for its shape (``choose_config``)."""
        if self.config is not None:
            return self.config
        key = sig.key()
        if key not in self._configs:
            from .choose_config import choose_config

            self._configs[key] = choose_config(self.kernel, self.target, sig, self.constants)
        return self._configs[key]

    def __call__(self, **tensors):
        tensors = self._padded(tensors)
        # a call like one seen before (the same names, shapes, dtypes and devices) was bound and
        # checked then: it goes straight to its loaded phases (binding costs ~8 us a call)
        # (in the call's own argument order: another order is another entry, not another build)
        seen = tuple((n, t.shape, t.dtype, t.device) if hasattr(t, "shape") else (n, type(t))
                     for n, t in tensors.items())
        fn = self._calls.get(seen)
        if fn is None:
            unknown = set(tensors) - set(self.kernel.tensors)
            if unknown:
                raise DslError(f"{self.kernel.name}: unknown argument(s) {', '.join(sorted(unknown))}")
            phases, artifacts, fn, key = self._prepare(tensors)
            if fn is None:
                fn = load_phases(get_target(self.target), phases, artifacts)
                self._cache[key] = (phases, artifacts, fn)
            self._calls[seen] = fn
        fn(tensors)


def compile(kernel: KernelDef, target: str = "interpret", config: dict[str, Any] | None = None,
            constants: dict[str, Any] | None = None, workdir: str | None = None) -> CompiledKernel:  # noqa: A001
    tgt = get_target(target)  # fail early on an unknown target
    if config:
        check_config(kernel, tgt, config)  # and on a config it or the kernel refuses
    return CompiledKernel(kernel, target, config, constants, workdir)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
