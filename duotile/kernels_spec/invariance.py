"""Batch invariance, measured: a row's outputs computed alone are bitwise its outputs inside batches of
other, random rows, at any place in the batch.

``check_rows(spec, case, run, device, seed)`` draws two batches of ``max(batches)`` rows from the
spec's inputs (seeds ``seed`` and ``seed + 1``): the rows under test and the others. For each row
under test it runs the row alone, then in each batch size of ``batches`` with random others around
it at a random place, and compares that place of every batched output with the alone run, bit for
bit (``compare.exact_mismatch``). ``run(**inputs)`` is the kernel call (it writes the outputs). The
alone run is first checked against the reference (``compare.mismatch``), so a call that writes
nothing cannot pass as invariant.

Which tensors a batch splits is read from the kernel: a tensor whose dimensions name its ``batch_dim``
is cut along that axis. Every other tensor (weights, shared pools such as ``moe_combine``'s expert rows)
is the base draw's, whole, in every call: the others' indices into a pool stay in range because both
draws are of the same case. Derived outputs (``spec.derived``, e.g. the FP8 copy of a decode's output in
its group-major rows) are checked on the alone run, as functions of the compared outputs.

A kernel whose batch rows are not independent by design (``moe_gemm_mxfp4``: a row's expert is its
place in the grouping) cannot be checked this way; ``NOT_ROW_WISE`` names such specs and why.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from .compare import exact_mismatch, mismatch

NOT_ROW_WISE = {
    "moe_gemm_mxfp4": "its rows are grouped by expert (the offsets table): a row's expert is its place in the "
                      "grouping, so a row moved among others is another computation (the runtime's batch "
                      "invariance test covers the MoE layer)",
}


def batch_axes(spec, case: dict | None = None) -> dict[str, int]:
    """{tensor: axis} for every tensor whose dimensions name the kernel's batch dimension, and those
    the spec says go with the batch in ``case`` (``Spec.batched_with``: a key stack a query)."""
    dim = spec.kernel.batch_dim
    if dim is None:
        raise ValueError(f"{spec.name}: the kernel declares no batch_dim; batch invariance does not apply")
    axes = {name: list(t.dims).index(dim) for name, t in spec.kernel.tensors.items() if dim in t.dims}
    if spec.batched_with is not None:
        axes.update(spec.batched_with(case or {}))
    if not any(o in axes for o in spec.outputs):
        raise ValueError(f"{spec.name}: no output has the batch dimension {dim}; nothing to compare")
    return axes


def _rows(t: torch.Tensor, axis: int, which: list[int]) -> torch.Tensor:
    return t.index_select(axis, torch.tensor(which, dtype=torch.int64, device=t.device)).clone()


def _batch(base: dict, others: dict, axes: dict, row: int, at: int, picks: list[int]) -> dict:
    """``base``'s row ``row`` at place ``at`` among ``others``' rows ``picks``; unsplit tensors are
    ``base``'s."""
    out = {}
    for name, t in base.items():
        if t is None or name not in axes:
            out[name] = t
            continue
        axis = axes[name]
        parts = [_rows(others[name], axis, picks[:at]), _rows(t, axis, [row]), _rows(others[name], axis, picks[at:])]
        out[name] = torch.cat(parts, axis).contiguous()
    return out


def check_rows(spec, case: dict, run: Callable[..., object], device: torch.device, seed: int,
               batches: tuple[int, ...] = (2, 16, 64), rows: int = 2) -> list[str]:
    """Lines saying what was compared; raises AssertionError naming the spec, case, row, batch size,
    place and output at the first row whose outputs depend on the batch around it."""
    if spec.name in NOT_ROW_WISE:
        raise ValueError(f"{spec.name}: not row-wise: {NOT_ROW_WISE[spec.name]}")
    dim, most = spec.kernel.batch_dim, max(batches)
    big = {**case, dim: most}
    axes = batch_axes(spec, case)
    base, others = spec.make_inputs(big, device, seed), spec.make_inputs(big, device, seed + 1)
    rng = random.Random(seed)
    done = []
    for row in sorted({0, *rng.sample(range(most), min(rows, most) - 1)}):
        alone = _batch(base, others, axes, row, 0, [])
        run(**alone)
        one = {**case, dim: 1}
        off = mismatch(spec, one, alone, spec.run_reference(alone, one))
        assert off is None, f"{spec.name} at {case}: row {row} of seed {seed} alone is not its reference: {off}"
        for n in batches:
            at = rng.randrange(n)
            picks = rng.sample(range(most), n - 1)
            mixed = _batch(base, others, axes, row, at, picks)
            run(**mixed)
            for out in spec.outputs:
                if out not in axes or mixed.get(out) is None:
                    continue
                got = mixed[out].narrow(axes[out], at, 1)
                off = exact_mismatch(f"{spec.name}/{out}", got, alone[out])
                assert off is None, (f"{spec.name} at {case}: row {row} of seed {seed} alone differs from it at "
                                     f"place {at} of a batch of {n} (seed {seed + 1}'s rows around it): {off}")
        done.append(f"row {row}: alone == in batches of {', '.join(map(str, batches))}")
    return done
