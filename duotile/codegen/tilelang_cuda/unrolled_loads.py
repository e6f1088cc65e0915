"""Unrolled load loops on CUDA targets: a short sequential loop that only reads global memory into
registers and folds it (``T.unroll``, which nvcc unrolls whole).

Such a loop is a split reduction's combine: ``for s < SPLIT: out += part_o[s] * w[s]``. Emitted as
``T.serial`` it stays a loop in the PTX, each trip's loads issued only after the previous trip's
adds, so a block waits one global-memory latency a trip. With V4's HCA decode at SPLIT 32 that is 32
latencies in a grid of 4 blocks a query, which fits the about 37 us a call that does not scale with
the rows (H100, 2026-12-06: 66.1 us at batch 1 against 94.7 us at SPLIT 16); the unrolled form has
not yet been timed on a GPU. Unrolled, the loads carry no dependence on the adds (the tensors are
``__restrict__`` and the loop writes only registers), so nvcc may issue several trips' loads before
their uses (the PTX holds every trip's loads straight-line; ptxas: 255 registers, no spill, for the
HCA combine's 32 trips of a 64 x 128 FP32 tile).

The rule holds where the loop is sequential (not pipelined, no data-read stop), runs a constant
number of trips up to ``MOST_TRIPS``, and its body is loads into registers and element-wise maps
only: nothing that synchronises, touches shared memory or nests a loop. The order of the adds is
the loop's order, as before: the bits do not change.
"""

from __future__ import annotations

import sympy

from ...dsl.ir import Op

MOST_TRIPS = 64
_REGISTER_SCOPES = ("fragment", "local")


def unrolls(loop: Op, scope: dict[int, str]) -> bool:
    """Whether ``loop`` (a ``for`` op) is emitted unrolled (the module docstring)."""
    a = loop.attrs
    if a.get("stages") or loop.args or a.get("at_most_once"):
        return False
    start, extent = sympy.sympify(a["start"]), sympy.sympify(a["extent"])
    if not (start.is_Integer and extent.is_Integer) or not 1 < int(extent) - int(start) <= MOST_TRIPS:
        return False
    body = loop.regions[0].ops
    if any(op.name not in ("load", "map") for op in body):
        return False
    loads = [op for op in body if op.name == "load"]
    return bool(loads) and all(scope.get(op.result.id) in _REGISTER_SCOPES for op in loads)
