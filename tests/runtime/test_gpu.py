"""The batch-invariance and prefill/decode checks on CUDA (run on the H200 with `-m gpu`)."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.engine import LLM
from duotile.runtime.layers.step import StepSeq
from duotile.runtime.reference import Model
from duotile.runtime.weights import Checkpoint

from . import test_engine as te
from .conftest import tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", ["v41-tiny", "v4-tiny"])
def test_batch_invariant_mode_is_bitwise_independent_of_the_batch_on_cuda(ckpt_dir, name):
    llm = LLM(ckpt_dir(name), batch_invariant=True, device="cuda")
    alone = te._alone(llm)
    assert len(alone.logits) == te.WATCHED.max_tokens
    for k in range(len(te.MIXES)):
        assert te._same(te._mixed(llm, k), alone), te.MIXES[k]


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_prefill_then_decode_bitwise_on_cuda(ckpt_dir, name):
    model = Model(Checkpoint.open(ckpt_dir(name)), batch_invariant=True, device="cuda")
    seq = tokens(70, model.config.vocab_size, seed=31)
    full = model.forward([StepSeq(model.new_cache(), seq)], all_logits=True)[0]
    cache = model.new_cache()
    got = [model.forward([StepSeq(cache, seq[:17])])[0]]
    got += [model.forward([StepSeq(cache, seq[p : p + 1])])[0] for p in range(17, 70)]
    assert torch.equal(torch.stack(got), full[16:])


def test_generated_rmsnorm_keeps_batch_invariance_on_cuda(ckpt_dir):
    """With kernels="generated" on the H200 the RMSNorms run as duotile's sm90 build (fp32 rows)."""
    llm = LLM(ckpt_dir("v41-tiny"), batch_invariant=True, device="cuda", kernels="generated")
    alone = te._alone(llm)
    assert llm.model.ctx.ops.calls["rms_norm"] > 0
    assert all(k.target == "sm90" for k in llm.model.ctx.ops._kernels.values())
    for k in (1, 3):
        assert te._same(te._mixed(llm, k), alone), te.MIXES[k]
