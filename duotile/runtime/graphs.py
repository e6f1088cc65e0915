"""CUDA graphs of a step's shape-static sections: two a decoder layer, each replayed as one launch.

Opt-in (``Model(graphs=True)``, ``duotile generate --graphs``): right on the one GPU workload it
has run, whose NaN logits came from a kernel reading past a tensor (docs/runtime.md, "CUDA graphs
of a step's sections"); its bitwise GPU test has not run yet.

A decode step of the generated model is mostly host time: every kernel call is a Python call, a
few output allocations and a launch, hundreds of them a step. Two parts of each decoder layer have
shapes fixed by the step's token count alone and read nothing from the host:

* ``attention``: the attention site's mHC mixes, the collapse, the norm and the projections of
  the rows (the queries, the window KV, the index queries and head weights: everything before a
  position or a cache is read, ``Attention.project``);
* ``ffn``: the attention's output projection and expand, then the FFN site's mixes, the
  collapse, the norm, the router, the experts and the expand.

Each can be recorded once as a CUDA graph and replayed: one launch instead of dozens of Python
kernel calls. The rest of the attention half (rope at the step's positions, the cache writes, the
compressors, the indexer and top-k, attention itself) runs as it comes: its index lists, cache
rows and lengths change every step.

``Sections`` keeps one graph per (section, input shapes). A section met for the first time runs
eagerly (its kernels build then, and the run shows which model ops served it); met again with the
same shapes, and if every op it ran was a generated kernel, it is captured into a graph and
replayed from then on. A section that ran a reference op (PyTorch code that may wait on the GPU
or read a value back) stays eager while it does, and ``eager`` says why; one whose capture raised
stays eager from then on, and ``failed`` holds the error (``report`` prints both). A step of
more than ``max_tokens`` tokens (a prefill chunk) runs eagerly: its launches are long beside
their host time.

The graph's inputs and outputs are fixed tensors: a replay copies the call's inputs into the
graph's own and returns the graph's outputs, which hold until the same section replays at the
same shapes (the next step's same layer). The kernels are the ones the eager run launches, with
the same configs, so a replay's result is bitwise the eager one. The call counts of the model ops
inside (``ctx.tally``) are added at each replay, as if the section had run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .model_ops import Tally

Outputs = tuple[torch.Tensor, ...]


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph, or a stand-in with .replay() (tests)
    inputs: tuple[torch.Tensor, ...]
    outputs: Outputs
    calls: dict[str, tuple[int, int]]  # the model op calls one run of the section makes
    held: tuple[torch.Tensor, ...] = ()  # cached tensors its launches read, kept alive (``hold``)


class Sections:
    """Graphs of sections by (name, input shapes); see the module docstring."""

    def __init__(self, max_tokens: int, capture: Callable | None = None, check: bool = False,
                 hold: Callable | None = None):
        """``check``: after each replay, run the section eagerly on the same inputs as well and
        raise ``ReplayMismatch`` where an output differs in a bit (a debugging mode: each section
        runs twice). ``hold``: a context manager yielding a list that collects the cached tensors
        the kernels launched inside it read (``GeneratedOps.holding``); each graph keeps those of
        its capture alive, since its replays read them at their addresses, whatever the caches
        that made them have dropped since."""
        self.max_tokens, self.check = max_tokens, check
        self._hold = hold or (lambda: contextlib.nullcontext(()))
        self._capture = capture or _cuda_capture
        self._pool = None
        self._graphs: dict[tuple, _Graph] = {}
        self._warm: set[tuple] = set()
        self.eager: dict[tuple, str] = {}  # sections kept eager while they run reference ops: key -> which
        self.failed: dict[tuple, str] = {}  # sections whose capture raised, eager from then on: key -> the error
        self.replays = 0

    def run(self, tally: Tally, name: tuple, fn: Callable[..., Outputs], *inputs: torch.Tensor) -> Outputs:
        """``fn(*inputs)``, from the section's graph where it has one (``inputs`` are tensors on
        one CUDA device, their first dimension the step's tokens)."""
        key = (name, *((tuple(t.shape), t.dtype) for t in inputs))
        hit = self._graphs.get(key)
        if hit is not None:
            return self._checked(tally, key, fn, self._replay(tally, hit, inputs), inputs)
        if inputs[0].shape[0] > self.max_tokens or key in self.failed:
            return fn(*inputs)
        if key not in self._warm:
            before = tally.snapshot()
            out = fn(*inputs)
            reference = sorted(op for op, (_, r) in tally.since(before).items() if r)
            if reference:  # tried again at its next call: a build made ahead may serve it then
                self.eager[key] = f"ran reference ops: {', '.join(reference)}"
            else:
                self.eager.pop(key, None)
                self._warm.add(key)
            return out
        try:
            hit = self._record(tally, fn, inputs)
        except Exception as err:  # noqa: BLE001 - any failed capture leaves the section eager, said so
            self.failed[key] = f"capture failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            return fn(*inputs)
        self._graphs[key] = hit
        return self._checked(tally, key, fn, self._replay(tally, hit, inputs), inputs)

    def _checked(self, tally: Tally, key: tuple, fn: Callable[..., Outputs], got: Outputs, inputs: tuple) -> Outputs:
        """``got`` (a replay's outputs), compared bit for bit with an eager run where ``check`` is on."""
        if not self.check:
            return got
        before = tally.snapshot()
        want = fn(*inputs)
        tally.restore(before)  # the check's run is not the model's
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape or g.dtype != w.dtype or not torch.equal(_bits(g), _bits(w)):
                raise ReplayMismatch(f"CUDA graph of section {key[0]} at input shapes "
                                     f"{[shape for shape, _ in key[1:]]}: replay {self.replays} output {i} differs "
                                     f"from the eager run ({_difference(g, w)})")
        return got

    def _record(self, tally: Tally, fn: Callable[..., Outputs], inputs: tuple) -> _Graph:
        own = tuple(t.clone() for t in inputs)
        before = tally.snapshot()
        try:
            with self._hold() as held:
                graph, outputs, self._pool = self._capture(fn, own, self._pool)
        finally:
            calls = tally.since(before)
            tally.restore(before)  # the capture ran no kernel: the replays count the calls
        return _Graph(graph, own, tuple(outputs), calls, tuple(held))

    def _replay(self, tally: Tally, hit: _Graph, inputs: tuple) -> Outputs:
        for own, new in zip(hit.inputs, inputs):
            own.copy_(new)
        hit.graph.replay()
        tally.add(hit.calls)
        self.replays += 1
        return hit.outputs

    def report(self) -> str:
        """One line: graphs held, replays made, sections kept eager and why."""
        eager = {**self.eager, **self.failed}
        why = "; ".join(sorted(set(eager.values())))
        tail = f"; {len(eager)} section shape(s) eager ({why})" if eager else ""
        return f"CUDA graphs: {len(self._graphs)} captured, {self.replays} replays{tail}"


class ReplayMismatch(RuntimeError):
    """A graph's replay gave other bits than the same section run eagerly (``Sections(check=True)``)."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as integers of its width: NaNs compare equal to themselves, -0 apart from 0."""
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(by_size[t.element_size()]) if t.is_floating_point() else t


def _difference(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} against {tuple(want.shape)} {want.dtype}"
    g, w = got.double(), want.double()
    apart = int((_bits(got) != _bits(want)).sum())
    return (f"{apart} of {got.numel()} elements; NaN: {int(g.isnan().sum())} replayed, {int(w.isnan().sum())} eager; "
            f"largest finite difference {float((g - w).nan_to_num(0.0).abs().max()):.3g}")


def _cuda_capture(fn: Callable[..., Outputs], inputs: tuple, pool):
    """Record ``fn(*inputs)`` as a CUDA graph in the sections' shared memory pool (the graphs replay
    one at a time, so their scratch memory may overlap); ``torch.cuda.graph`` waits for the work
    queued before it."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn(*inputs)
    return graph, outputs, pool
