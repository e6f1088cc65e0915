"""A CUDA graph's replay emulated on the CPU, for the graph tests (test_graphs.py).

A CUDA graph records the kernels a section launches and replays them on the same memory: no Python
of the section runs again, no allocation is made again, and every tensor keeps its place. The
plain stand-in of test_graphs.py (``StandIn``) runs the section's Python again at each replay,
which hides whatever the Python does beside its kernels (a cache it fills, a value it reads on the
host, an allocation it makes fresh). ``Recorded`` keeps only what a graph keeps: during the capture
run, each generated kernel launch (``GeneratedOps._kernel``'s kernels, wrapped) and each PyTorch
op outside a kernel, with the very tensors they took; a replay runs them again in order, each op's
results written into the tensors the capture's op returned. Allocations and views are not run
again (a graph's memory stays where it was, with what it last held); an op that returns a host
value (a sync, which a capture refuses) raises during the capture.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import duotile.runtime.generated as generated

_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


class HostRead(RuntimeError):
    """A section read a device value on the host while captured (a CUDA capture refuses it)."""


class _Log(TorchDispatchMode):
    def __init__(self, steps: list):
        super().__init__()
        self.steps, self.in_kernel = steps, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.in_kernel or func.is_view or func.overloadpacket.__name__ in _ALLOCATIONS:
            return out
        flat, _ = tree_flatten(out)
        if not all(isinstance(t, torch.Tensor) for t in flat):
            raise HostRead(f"{func} returned a host value inside a captured section")
        self.steps.append(lambda: _rerun(func, args, kwargs, flat))
        return out


def _rerun(func, args, kwargs, kept: list) -> None:
    new, _ = tree_flatten(func(*args, **kwargs))
    for old, value in zip(kept, new):
        if value is not old:
            old.copy_(value)


class Recorded:
    """A section captured as a graph would be: ``replay`` runs its kernels and PyTorch ops again on the
    capture's tensors, and nothing else (module docstring)."""

    def __init__(self, fn, inputs):
        self.steps: list = []
        log = _Log(self.steps)
        real = generated.GeneratedOps._kernel

        def kernel(ops, *args, **kwargs):  # each launch made inside: run, and kept for the replays
            compiled = real(ops, *args, **kwargs)

            def launch(**tensors):
                log.in_kernel += 1
                try:
                    compiled(**tensors)
                finally:
                    log.in_kernel -= 1
                self.steps.append(lambda: compiled(**tensors))

            return launch

        generated.GeneratedOps._kernel = kernel
        try:
            with log:
                self.outputs = tuple(fn(*inputs))
        finally:
            generated.GeneratedOps._kernel = real
        self.replayed = 0

    def replay(self) -> None:
        for step in self.steps:
            step()
        self.replayed += 1


def recorded_capture():
    """A ``Sections`` capture function making ``Recorded`` graphs, and the list of them."""
    made: list[Recorded] = []

    def capture(fn, inputs, pool):
        graph = Recorded(fn, inputs)
        made.append(graph)
        return graph, graph.outputs, pool

    return capture, made
