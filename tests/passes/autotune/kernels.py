"""Tiny kernels and specs for the autotune tests (interpret target, CPU)."""

from __future__ import annotations

import torch

from duotile import dsl
from duotile.kernels_spec.registry import Spec

from ..test_check_batch_invariance import col_sum  # sums over its batch dim T: rejected


@dsl.kernel
def scale_rows(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["N", "D", dsl.f32], *,
               BN: dsl.Tunable = dsl.choice(2, 4, 8),
               SKIP: dsl.Tunable = dsl.boolean(False),
               MODE: dsl.Tunable = dsl.enum("plain", "broken", "slow")):
    # SKIP=True launches half the programs (a deliberately wrong config); MODE="broken" builds a
    # tile whose shape does not match the store (fails to compile).
    extent = dsl.cdiv(x.N, 2 * BN) if SKIP else dsl.cdiv(x.N, BN)
    for i in dsl.grid(extent):
        t = dsl.load(x[i * BN, 0], (BN, x.D))
        if MODE == "broken":
            t = t + dsl.load(x[i * BN, 0], (BN + 1, x.D))
        dsl.store(y[i * BN, 0], t * 2.0)


def _inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(case["N"], case["D"], generator=g)
    return {"x": x.to(device), "y": torch.empty_like(x).to(device)}


SCALE_SPEC = Spec(kernel=scale_rows, reference=lambda x: {"y": x * 2.0}, make_inputs=_inputs, outputs=("y",),
                  cases={"tiny": {"N": 16, "D": 8}}, build_cases={}, tolerance=lambda case, out: (1e-6, 1e-6))


def _col_inputs(case, device, seed):
    x = torch.randn(case["T"], case["D"], generator=torch.Generator().manual_seed(seed))
    return {"x": x.to(device), "y": torch.empty(case["D"]).to(device)}


COL_SUM_SPEC = Spec(kernel=col_sum, reference=lambda x: {"y": x.sum(0)}, make_inputs=_col_inputs, outputs=("y",),
                    cases={"tiny": {"T": 16, "D": 8}}, build_cases={}, tolerance=lambda case, out: (1e-5, 1e-5))
