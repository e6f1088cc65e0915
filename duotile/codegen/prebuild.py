"""Builds many call signatures at once, in worker processes, into the artifact cache.

A generation on generated kernels meets dozens of distinct call signatures, and an sm90 build
takes seconds: made one at a time at their first call, a tiny model's first generation spends
minutes compiling. ``signatures_of`` lists the signatures a set of compiled kernels has been
called with (an interpreter run on a CPU finds them all); ``prebuild`` builds a list of them for a
target in parallel processes, each choosing its config as ``codegen.compile`` would with none
given. The builds land in the artifact cache (``$DUOTILE_CACHE``), where the first call of the same
signature finds them: a signature prebuilt is a cache hit, one missed is built at its call as
before. The list travels as JSON (``save`` / ``load``), so one machine can find it and another
build it.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Signature:
    """One build: a spec, its tensors' shapes and dtypes, and the constants it was compiled with."""

    spec: str
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, torch dtype name)
    constants: tuple[tuple[str, Any], ...] = ()

    def to_json(self) -> dict:
        return {"spec": self.spec, "tensors": [[n, list(s), d] for n, s, d in self.tensors],
                "constants": dict(self.constants)}

    @classmethod
    def from_json(cls, obj: dict) -> Signature:
        return cls(obj["spec"], tuple((n, tuple(s), d) for n, s, d in obj["tensors"]),
                   tuple(sorted(obj.get("constants", {}).items())))

    @classmethod
    def of(cls, spec: str, tensors: dict, constants: dict | None = None) -> Signature:
        """The signature of a call of ``spec`` with ``tensors`` (any device, meta too; ``None``
        for an optional tensor left out)."""
        return cls(spec, tuple((n, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))
                               for n, t in tensors.items() if t is not None),
                   tuple(sorted((constants or {}).items())))

    def meta_tensors(self) -> dict:
        """Tensors on the meta device with these shapes and dtypes (what binding reads)."""
        import torch

        with torch.device("meta"):
            return {n: torch.empty(s, dtype=getattr(torch, d)) for n, s, d in self.tensors}


def build_key(kernel, sig: Signature) -> tuple:
    """What tells ``kernel``'s builds apart for ``sig``: calls differing only in a dynamic size
    share a key (and a build)."""
    return sig.spec, kernel.kernel.bind(sig.meta_tensors()).key(), sig.constants


def key_of(sig: Signature) -> tuple:
    """``build_key`` of a signature of a registered spec (a list read back, say)."""
    from types import SimpleNamespace

    from ..kernels_spec import get

    return build_key(SimpleNamespace(kernel=get(sig.spec).kernel), sig)


def call_signature(kernel, tensors: dict) -> tuple[tuple, Signature]:
    """(build key, signature) of a call of the ``CompiledKernel`` ``kernel`` with ``tensors`` (padded
    as the call pads them), without building anything."""
    padded = kernel._padded(tensors)
    sig = Signature.of(kernel.kernel.name, padded, kernel.constants)
    return build_key(kernel, sig), sig


def signatures_of(kernels) -> list[Signature]:
    """The distinct build signatures the ``CompiledKernel``s in ``kernels`` were called with: one
    call of each, where calls differing only in a dynamic size share a build."""
    out, keys = [], set()
    for kernel in kernels:
        for seen in kernel._calls:
            tensors = tuple((n, tuple(int(d) for d in shape), str(dtype).removeprefix("torch."))
                            for n, shape, dtype, _ in seen)  # the call's (name, shape, dtype, device)
            sig = Signature(kernel.kernel.name, tensors, tuple(sorted((kernel.constants or {}).items())))
            key = build_key(kernel, sig)
            if key not in keys:
                keys.add(key)
                out.append(sig)
    return out


def save(signatures: list[Signature], path: str | Path) -> None:
    Path(path).write_text(json.dumps([s.to_json() for s in signatures], indent=1) + "\n")


def load(path: str | Path) -> list[Signature]:
    try:
        return [Signature.from_json(o) for o in json.loads(Path(path).read_text())]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a list of build signatures ({type(err).__name__}: {err})") from None


@dataclass
class Outcome:
    signature: Signature
    ok: bool
    seconds: float
    cache: str = ""  # "hit" / "miss" / ... of the first phase's artifact
    error: str = ""
    config: dict = field(default_factory=dict)


def build_one(sig: Signature, target: str, prepare_load: bool = True) -> Outcome:
    """Build ``sig`` for ``target`` with the config a user gets (one process's share of a prebuild),
    and with ``prepare_load`` what the target's loader does first (``Target.prepare_load``)."""
    from ..kernels_spec import get
    from .compile import compile as compile_kernel
    from .target import get_target

    t0 = time.perf_counter()
    try:
        kernel = compile_kernel(get(sig.spec).kernel, target, constants=dict(sig.constants) or None)
        arts = kernel.artifacts(**sig.meta_tensors())
        if prepare_load:
            for art in arts:
                get_target(target).prepare_load(art)
        config = {**arts[0].meta.get("config", {}), **arts[0].meta.get("knobs", {})}
        return Outcome(sig, True, time.perf_counter() - t0, arts[0].meta.get("cache", ""), config=config)
    except Exception as err:  # noqa: BLE001 - reported per signature; its call builds (and raises) again
        return Outcome(sig, False, time.perf_counter() - t0, error=f"{type(err).__name__}: {str(err)[:300]}")


def prebuild(signatures: list[Signature], target: str, jobs: int = 4, prepare_load: bool = True) -> list[Outcome]:
    """Build every signature for ``target`` in ``jobs`` processes (spawned: no CUDA state is
    shared), in the order given; returns one outcome each."""
    if jobs < 1:
        raise ValueError(f"jobs must be 1 or more, got {jobs}")
    if jobs == 1 or len(signatures) <= 1:
        return [build_one(s, target, prepare_load) for s in signatures]
    n = len(signatures)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(build_one, signatures, [target] * n, [prepare_load] * n))
