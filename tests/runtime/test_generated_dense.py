"""The generated `linear` op picks its GEMM by the activation's dtype, never by its values: a value
check waits for the GPU at every call and lets one row's values choose the kernel of the others."""

from __future__ import annotations

import torch

from duotile.runtime.generated import GeneratedOps
from duotile.runtime.layers.common import Ctx, matmul
from duotile.runtime.ops import FastOps


def _specs(ops: GeneratedOps) -> set[str]:
    return {spec for spec, *_ in ops._kernels}


def test_a_bf16_activation_takes_the_bf16_gemm_and_an_fp32_one_the_split_gemm_whatever_its_values():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 32, generator=g).to(torch.bfloat16).float()  # values BF16 holds
    x = torch.randn(3, 32, generator=g).to(torch.bfloat16)
    bf16, fp32 = Ctx(GeneratedOps(FastOps())), Ctx(GeneratedOps(FastOps()))
    y16 = matmul(bf16, x, w)
    y32 = matmul(fp32, x.float(), w)  # the same values, in FP32: split, though BF16 would hold them
    assert _specs(bf16.ops) == {"gemm"} and _specs(fp32.ops) == {"gemm_f32"}
    assert bf16.tally.calls["linear"] == [1, 0] and fp32.tally.calls["linear"] == [1, 0]
    reference = x.float() @ w.T
    torch.testing.assert_close(y16, reference, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y32, reference, rtol=1e-6, atol=1e-6)


def test_the_choice_reads_no_activation_values(monkeypatch):
    """torch.equal on the activation was the value check; the weight's is made once and kept."""
    w = torch.ones(8, 16)
    ctx = Ctx(GeneratedOps(FastOps()))
    matmul(ctx, torch.ones(2, 16, dtype=torch.bfloat16), w)  # the weight's check, once
    seen = []
    real = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: seen.append(a.shape) or real(a, b))
    for rows in (1, 5):
        matmul(ctx, torch.ones(rows, 16, dtype=torch.bfloat16), w)
        matmul(ctx, torch.ones(rows, 16), w)
    assert seen == []


def test_a_capture_holds_the_weight_copies_its_launches_read_and_nothing_else():
    """A CUDA graph reads a cached BF16 weight copy at its address at every replay; a replay runs no
    Python, so it does not keep the copy recent in the ops' cache, which may drop it (the most
    recent BF16_KEPT). `holding` gives the graph the copies its launches read, so their memory is
    never handed to another tensor while the graph lives; not the launch's other tensors (the
    capture's own allocations, which the graphs' shared pool may hand to a later capture)."""
    ctx = Ctx(GeneratedOps(FastOps()))
    w = torch.randn(6, 16).to(torch.bfloat16).float()  # values BF16 holds: a BF16 copy is kept
    x = torch.randn(3, 16).to(torch.bfloat16)
    with ctx.ops.holding() as held:
        y = matmul(ctx, x, w)
        matmul(ctx, x, torch.randn(8, 16))  # not BF16 values: no copy kept, nothing held
    assert ctx.ops._held is None  # only while capturing
    copies = [c for _, _, c in ctx.ops._bf16.values() if c is not None]
    assert len(copies) == 1 and len(held) == 1 and held[0] is copies[0]
    ctx.ops._bf16.clear()  # dropped by the cache: still held
    assert held[0].shape == (6, 16)
    matmul(ctx, x, w)
    assert len(held) == 1  # nothing is added outside the block
    torch.testing.assert_close(y, x.float() @ w.T, rtol=1e-6, atol=1e-6)
