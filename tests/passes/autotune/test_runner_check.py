"""The tuner's output check: masked logits (-inf in the reference and in the candidate) are
equal, not off by an infinite error; a finite value where -inf belongs is off."""

from __future__ import annotations

import torch

from duotile.kernels_spec import load_all
from duotile.passes.autotune.runner import Runner


def test_equal_infinities_pass_and_a_finite_one_where_inf_belongs_fails():
    spec = load_all()["indexer_logits"]
    runner = Runner(spec, spec.cases["few_visible"], "interpret", measure=False)
    out = spec.outputs[0]
    want = runner.expected[out]
    assert torch.isinf(want).any(), "the case must mask some rows"
    runner.inputs[out].copy_(want)
    assert runner._check()[0], runner._check()[1]
    where = torch.isinf(want).nonzero()[0]
    runner.inputs[out][tuple(where)] = 0.0
    ok, why, _ = runner._check()
    assert not ok and "1/" in why, why
