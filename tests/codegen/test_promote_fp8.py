"""sm90's fp8 promotion (``fp8_promote_k``) applies to an accumulator carried across the K loop,
never to one the loop body makes afresh each step (a block-scaled gemm's partial sum, which the
kernel scales and adds itself).

Regression: such a per-step gemm went into a step fragment cleared every ``fp8_promote_k / BK``
steps and was added into the fresh accumulator only on the last of them, so the kernel's own
scaling read a partial sum that was never cleared and missed most steps."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target

pytest.importorskip("tilelang")


@dsl.kernel
def step_scaled(a: dsl.Tensor["M", "K", dsl.f8e4m3], b: dsl.Tensor["N", "K", dsl.f8e4m3],
                c: dsl.Tensor["M", "N", dsl.f32], *, BK: dsl.Tunable = dsl.choice(32)):
    """c = sum over K steps k of (k + 1) * (A_k @ B_k^T): each step's product is scaled on its own."""
    for m, n in dsl.grid(dsl.cdiv(a.M, 64), dsl.cdiv(b.N, 64)):
        acc = dsl.zeros((64, 64), dsl.f32)
        for k in dsl.pipelined(dsl.cdiv(a.K, BK), stages=2):
            part = dsl.zeros((64, 64), dsl.f32, role="accumulator")
            dsl.gemm(dsl.load(a[m * 64, k * BK], (64, BK), role="operand"),
                     dsl.load(b[n * 64, k * BK], (64, BK), role="operand"), part, transpose_b=True)
            acc[:] = acc + part * (k + 1)
        dsl.store(c[m * 64, n * 64], acc)


@dsl.kernel
def carried(a: dsl.Tensor["M", "K", dsl.f8e4m3], b: dsl.Tensor["N", "K", dsl.f8e4m3],
            c: dsl.Tensor["M", "N", dsl.f32], *, BK: dsl.Tunable = dsl.choice(32)):
    for m, n in dsl.grid(dsl.cdiv(a.M, 64), dsl.cdiv(b.N, 64)):
        acc = dsl.zeros((64, 64), dsl.f32, role="accumulator")
        for k in dsl.pipelined(dsl.cdiv(a.K, BK), stages=2):
            dsl.gemm(dsl.load(a[m * 64, k * BK], (64, BK), role="operand"),
                     dsl.load(b[n * 64, k * BK], (64, BK), role="operand"), acc, transpose_b=True)
        dsl.store(c[m * 64, n * 64], acc)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(64, 256, generator=g).to(torch.float8_e4m3fn),
            "b": torch.randn(64, 256, generator=g).to(torch.float8_e4m3fn), "c": torch.zeros(64, 64)}


def _sm90(kernel, knobs: dict) -> str:
    t = _tensors()
    module, resolved = specialize(kernel, kernel.bind(t), "sm90", knobs)
    return get_target("sm90").generate(module, resolved).stages["tilelang"]


def test_the_interpreter_scales_every_step():
    t = _tensors()
    codegen.compile(step_scaled, "interpret")(**t)
    a, b = t["a"].float(), t["b"].float()
    want = sum((k + 1) * a[:, 32 * k:32 * k + 32] @ b[:, 32 * k:32 * k + 32].t() for k in range(8))
    assert torch.allclose(t["c"], want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("warp_specialize", ["auto", "manual"])
def test_a_fresh_accumulator_each_step_is_not_promoted(warp_specialize):
    text = _sm90(step_scaled, {"fp8_promote_k": 128, "warp_specialize": warp_specialize})
    assert "_step" not in text  # no step fragment, no deferred add
    gemm = next(line for line in text.splitlines() if "gemm(" in line)
    assert "clear_accum=True" in gemm, gemm  # each step's product starts from zero


def test_a_carried_accumulator_is_still_promoted():
    text = _sm90(carried, {"fp8_promote_k": 128})  # K tile 32: added every fourth step
    assert "_step" in text and "clear_accum=(k) % 4 == 0" in text
