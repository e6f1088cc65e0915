"""Builds ahead, in rounds: a workload's kernels built in parallel processes before it runs on them.

A model on generated kernels meets dozens of build signatures on its first steps, and an sm90
build takes seconds to tens of seconds: met one at a time, a real-width model's first prefill and
decode steps spend many minutes compiling. `duotile build --signatures` builds a list in parallel,
but the list must come from somewhere, and the kernels a step calls depend on what the steps
before them returned. `build_ahead(ops, workload, jobs)` finds it by running the workload itself:

1. run the workload with every kernel call whose build is not known to exist deferred: the call's
   signature is noted and its model op runs on the reference (`GeneratedOps` declines the call);
2. build the new signatures in ``jobs`` processes (`codegen.prebuild`, the config a user gets);
3. again, until a round meets no new signature. A kernel built in one round runs in the next, so a
   model op of several kernels (MoE: permute, two grouped GEMMs, the combine) is found in as many
   rounds as it has kernels in a row.

The workload's outputs in the rounds are not the generated model's (some ops ran on the reference):
only the signatures are kept. A build that fails in a worker is made again at its call, where it
raises as it would have without building ahead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ...codegen import prebuild


class BuildDeferred(Exception):
    """A kernel call whose build is not made yet (caught by `GeneratedOps.kernel_for`'s wrapper)."""


@dataclass
class Ahead:
    """The signatures built (or tried) so far and those met but not built, by build key."""

    ready: set = field(default_factory=set)
    pending: dict = field(default_factory=dict)  # key -> (target, Signature)

    def call(self, compiled, tensors: dict):
        key, sig = prebuild.call_signature(compiled, tensors)
        if key in self.ready:
            return compiled(**tensors)
        self.pending.setdefault(key, (compiled.target, sig))
        raise BuildDeferred(sig.spec)


class DeferringKernel:
    """A compiled kernel whose calls without a build are deferred (module docstring)."""

    def __init__(self, compiled, ahead: Ahead):
        self.compiled, self.ahead = compiled, ahead

    def __call__(self, **tensors):
        return self.ahead.call(self.compiled, tensors)


@dataclass
class Round:
    signatures: int  # new signatures built in this round
    failed: int  # of them, builds that raised in their worker (made again at their call)
    run_s: float  # the workload's time in this round
    build_s: float


@dataclass
class Report:
    rounds: list[Round]  # the last one met nothing new
    keys: set  # the build keys made (or tried): every one the workload meets

    @property
    def built(self) -> int:
        return sum(r.signatures for r in self.rounds)


def build_ahead(ops, workload: Callable[[], object], jobs: int, rounds: int = 12,
                log: Callable[[str], None] | None = None,
                save: Callable[[list[prebuild.Signature]], None] | None = None,
                built: list[prebuild.Signature] = ()) -> Report:
    """Run ``workload`` on ``ops`` (a `GeneratedOps`) until it meets no signature not built; build
    each round's new ones in ``jobs`` processes. ``built``: signatures built already (a list
    prebuilt), whose calls run at once. ``save`` gets them and every signature met so far after
    each round (for ``duotile build --signatures`` elsewhere)."""
    ahead, done, met = Ahead(), [], list(built)
    ahead.ready.update(prebuild.key_of(sig) for sig in built)
    ops._ahead = ahead
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            workload()
            t1 = time.perf_counter()
            new = list(ahead.pending.items())
            ahead.pending.clear()
            met += [sig for _key, (_target, sig) in new]
            if save:
                save(met)
            by_target: dict[str, list] = {}
            for _key, (target, sig) in new:
                by_target.setdefault(target, []).append(sig)
            failed = sum(not o.ok for target, sigs in by_target.items()
                         for o in prebuild.prebuild(sigs, target, jobs))
            ahead.ready.update(key for key, _ in new)
            done.append(Round(len(new), failed, t1 - t0, time.perf_counter() - t1))
            if log:
                log(f"build ahead, round {len(done)}: {len(new)} new signature(s) ({failed} failed) built in "
                    f"{done[-1].build_s:.1f} s after a {done[-1].run_s:.1f} s run")
            if not new:
                return Report(done, set(ahead.ready))
        raise RuntimeError(f"build ahead: the workload still met new signatures after {rounds} rounds")
    finally:
        ops._ahead = None
