"""Building ahead by rounds (runtime/generated/ahead.py) on the interpreter: a model op of two kernels
in a row (an FP8 block-scaled linear: ``quantize`` then ``gemm_blockscaled``) is found in two rounds,
runs on the reference while its builds are missing, and afterwards on its kernels, bitwise as
without building ahead."""

from __future__ import annotations

import torch

from duotile.codegen import prebuild
from duotile.runtime import quant
from duotile.runtime.generated import GeneratedOps
from duotile.runtime.generated.ahead import build_ahead
from duotile.runtime.layers.common import Ctx, Linear, rms_norm
from duotile.runtime.ops import FastOps

BLOCK = 128


def _linear() -> tuple[Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g) / 16
    codes, scales = quant.quantize_fp8_blocks(w, BLOCK)
    packed = ("fp8", codes, scales.view(torch.uint8))
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    return Linear(None, BLOCK, packed, BLOCK), x


def test_a_two_kernel_op_is_found_in_two_rounds_then_runs_on_its_kernels_bitwise():
    linear, x = _linear()
    ctx = Ctx(GeneratedOps(FastOps()))
    seen = []

    def workload():
        before = ctx.tally.snapshot()
        seen.append((linear(ctx, x), ctx.tally.since(before)["linear_q"]))

    report = build_ahead(ctx.ops, workload, jobs=1)
    assert [r.signatures for r in report.rounds] == [1, 1, 0]  # quantize, then gemm_blockscaled, then none
    assert [calls for _, calls in seen] == [(0, 1), (0, 1), (1, 0)]  # (generated, reference) calls
    assert ctx.ops._ahead is None
    after = linear(ctx, x)
    plain_ctx = Ctx(GeneratedOps(FastOps()))
    assert torch.equal(after, linear(plain_ctx, x))
    met = {prebuild.build_key(k, s) for k in plain_ctx.ops._kernels.values() for s in prebuild.signatures_of([k])}
    assert met == report.keys  # every build the op makes was made ahead, and nothing else


def test_a_round_that_meets_nothing_new_ends_it_and_a_workload_that_keeps_meeting_new_ones_is_stopped():
    ops = GeneratedOps(FastOps())
    ctx = Ctx(ops)
    assert [r.signatures for r in build_ahead(ops, lambda: None, jobs=1).rounds] == [0]
    rows = iter(range(1, 100))

    def growing():  # a new static size each round: rmsnorm's columns
        n = 8 * next(rows)
        rms_norm(ctx, torch.ones(2, n), torch.ones(n), 1e-6)

    try:
        build_ahead(ops, growing, jobs=1, rounds=3)
    except RuntimeError as err:
        assert "after 3 rounds" in str(err)
    else:
        raise AssertionError("an endless workload was not stopped")
    assert ops._ahead is None


def test_signatures_built_before_run_at_once_and_are_saved_with_the_new_ones():
    """A list prebuilt (``built``): its calls run on their kernels in the first round; only what
    the list lacks is deferred, and ``save`` gets the list and the new signatures."""
    linear, x = _linear()
    first = Ctx(GeneratedOps(FastOps()))
    linear(first, x)  # no building ahead: both kernels built at their calls
    listed = [s for s in first.ops.signatures() if s.spec == "quantize"]
    ctx, seen, saved = Ctx(GeneratedOps(FastOps())), [], []

    def workload():
        before = ctx.tally.snapshot()
        linear(ctx, x)
        seen.append(ctx.tally.since(before)["linear_q"])

    report = build_ahead(ctx.ops, workload, jobs=1, built=listed, save=saved.append)
    assert [r.signatures for r in report.rounds] == [1, 0]  # gemm_blockscaled only
    assert seen == [(0, 1), (1, 0)]
    assert [s.spec for s in saved[-1]] == ["quantize", "gemm_blockscaled"]
    assert prebuild.key_of(listed[0]) in report.keys
