"""The runtime with duotile's generated kernels swapped in (`kernels="generated"`)."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.engine import LLM
from duotile.runtime.generated import GeneratedOps
from duotile.runtime.ops import FastOps, InvariantOps
from duotile.runtime.reference import make_ops

from .test_engine import MIXES, WATCHED, _alone, _mixed, _same


def test_rms_norm_runs_the_rmsnorm_kernel_and_matches_the_primitive():
    ops = GeneratedOps(FastOps())
    x, w = torch.randn(2, 5, 96), 1 + 0.1 * torch.randn(96)
    got = ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, FastOps().rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    assert ops.calls == {"rms_norm": 1} and got.shape == x.shape and got.dtype == torch.float32
    torch.testing.assert_close(ops.rms_norm(x, None, 1e-6), FastOps().rms_norm(x, None, 1e-6))  # no weight: base
    assert ops.calls == {"rms_norm": 1}
    assert ops.sum is not None and ops.invariant is False  # everything else is the base flavour's


def test_unknown_kernels_choice_is_rejected():
    with pytest.raises(ValueError, match="kernels: 'triton' is not one of reference, generated"):
        make_ops(False, "triton")
    assert isinstance(make_ops(True, "generated").base, InvariantOps)


def test_generated_kernels_follow_the_reference_model(ckpt_dir):
    ref = LLM(ckpt_dir("v41-tiny"))
    gen = LLM(ckpt_dir("v41-tiny"), kernels="generated")
    a, b = _alone(ref), _alone(gen)
    assert gen.model.ctx.ops.calls["rms_norm"] > 0
    assert len(a.logits) == len(b.logits) == WATCHED.max_tokens
    for x, y in zip(a.logits, b.logits):  # the same math, the row sums in another order (measured: equal
        torch.testing.assert_close(y, x, rtol=1e-2, atol=1e-2)  # after the bf16 rounding of activations)


def test_batch_invariance_holds_with_generated_kernels(ckpt_dir):
    """The rmsnorm kernel reduces each row alone, in an order fixed by its config: a request's logits
    stay bitwise the same in any batch."""
    llm = LLM(ckpt_dir("v41-tiny"), batch_invariant=True, kernels="generated")
    alone = _alone(llm)
    assert llm.model.ctx.ops.calls["rms_norm"] > 0
    for k in (1, 2):
        assert _same(_mixed(llm, k), alone), MIXES[k]


def test_generated_kernels_take_the_tuned_config(monkeypatch):
    """The runtime compiles with config=None, so codegen.compile takes a tuned config when the cache
    or the shipped table has one; here a stand-in cache answers ROWS=2."""
    from duotile.passes.autotune import cache

    asked = []

    def fake_lookup(kernel, target, shapes, **kw):
        asked.append((kernel.name, target, dict(shapes)))
        return {"ROWS": 2}, []

    monkeypatch.setattr(cache, "lookup", fake_lookup)
    ops = GeneratedOps(FastOps())
    x, w = torch.randn(5, 64), torch.ones(64)
    ops.rms_norm(x, w, 1e-6)
    assert asked and asked[0][:2] == ("rmsnorm", "interpret")
    (kernel,) = ops._kernels.values()
    ((module,), _artifacts, _fn), = kernel._cache.values()
    assert module.config == {"ROWS": 2}


def test_a_generation_with_a_changing_batch_builds_once_per_width(capsys):
    """Token counts change every step (prefill chunks, a batch that shrinks as requests finish):
    the rmsnorm build is dynamic in them, so builds are bounded by the distinct widths."""
    from duotile.cli import main

    assert main(["generate", "--prompt-ids", "1", "2", "3", "--max-tokens", "12", "--requests", "3",
                 "--kernels", "generated", "--no-progress"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("generated kernels: rms_norm"))
    calls, builds = (int(w) for w in line.replace("(s)", "").split() if w.isdigit())
    assert calls > 50 and 1 <= builds <= 3, line
