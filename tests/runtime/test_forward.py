"""Reference forward: prefill-then-decode equals the full-sequence forward (model.md 6.4 lengths)."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.layers.step import StepSeq
from duotile.runtime.reference import Model

from .conftest import tokens

LENGTHS = (1, 3, 4, 5, 15, 16, 17, 64, 200)
DECODE = 3


def _full(model, seq):
    return model.forward([StepSeq(model.new_cache(), seq)], all_logits=True)[0]


def _prefill_then_decode(model, seq, n_prompt, n_decode):
    cache = model.new_cache()
    out = [model.forward([StepSeq(cache, seq[:n_prompt])])[0]]
    for pos in range(n_prompt, n_prompt + n_decode):
        out.append(model.forward([StepSeq(cache, seq[pos : pos + 1])])[0])
    return torch.stack(out)


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_prefill_then_decode_is_bitwise_the_full_forward_in_invariant_mode(build, name):
    """BF16 activations with every quantisation round trip: in batch-invariant mode each token's math is
    independent of how many tokens share its step, so decode logits equal full-forward logits exactly."""
    model = build(name, batch_invariant=True)
    seq = tokens(max(LENGTHS) + DECODE, model.config.vocab_size, seed=11)
    full = _full(model, seq)
    for n in LENGTHS:
        got = _prefill_then_decode(model, seq, n, DECODE)
        assert torch.equal(got, full[n - 1 : n + DECODE]), f"prompt length {n}"


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_prefill_then_decode_matches_full_forward_fp32(build, name):
    """Default (fast) kernels in FP32 without quantisation: only summation order differs -> ~1e-6."""
    model = build(name, dtype=torch.float32, quant=False)
    seq = tokens(max(LENGTHS) + DECODE, model.config.vocab_size, seed=12)
    full = _full(model, seq)
    for n in LENGTHS:
        got = _prefill_then_decode(model, seq, n, DECODE)
        torch.testing.assert_close(got, full[n - 1 : n + DECODE], rtol=1e-4, atol=1e-4, msg=f"length {n}")


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_prefill_then_decode_close_to_full_forward_bf16_fast(build, name):
    """Default kernels with BF16 + FP8/FP4 rounding: a 1-ulp FP32 difference can flip a BF16 or FP8 bin
    (2^-8 / 2^-4 relative) and propagate, so agreement is statistical: small mean error, same argmax."""
    model = build(name)
    seq = tokens(max(LENGTHS) + DECODE, model.config.vocab_size, seed=13)
    full = _full(model, seq)
    got = torch.cat([_prefill_then_decode(model, seq, n, DECODE) for n in LENGTHS])
    want = torch.cat([full[n - 1 : n + DECODE] for n in LENGTHS])
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert rel.mean() < 0.1, rel  # measured 0.01-0.06 on these seeds
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def test_chunked_prefill_is_bitwise_the_full_forward_in_invariant_mode(build):
    model = build("v41-tiny", batch_invariant=True)
    seq = tokens(90, model.config.vocab_size, seed=14)
    full = _full(model, seq)
    cache, outs, at = model.new_cache(), [], 0
    for size in (7, 1, 16, 2, 31, 33):
        outs.append(model.forward([StepSeq(cache, seq[at : at + size])], all_logits=True)[0])
        at += size
    assert torch.equal(torch.cat(outs), full)


@pytest.mark.parametrize("name", ["v4-tiny", "v41-tiny"])
def test_a_decode_steps_row_wise_attention_ops_run_once_a_layer_whatever_the_batch(name):
    """Norms, rotations, roundings, pooling, top-k and sparse attention are called as often at batch 8
    as at batch 1 (the step's sequences together), and so are the index scores and V4.1's candidate
    pool (each query its own sequence's keys).
    Every sequence's token completes a window of every compressor (positions 47 + 16 i), so that
    no call is left out for want of rows."""
    from duotile.runtime.presets import get_preset
    from duotile.runtime.random_weights import RandomCheckpoint

    model = Model(RandomCheckpoint(get_preset(name), seed=6))
    calls = {}
    for batch in (1, 8):
        caches = [model.new_cache() for _ in range(batch)]
        model.forward([StepSeq(c, torch.arange(3, 3 + 47 + 16 * i)) for i, c in enumerate(caches)])
        before = model.ctx.tally.snapshot()
        model.forward([StepSeq(c, torch.tensor([5])) for c in caches])
        calls[batch] = {k: g + r for k, (g, r) in model.ctx.tally.since(before).items()}
    for op in ("sparse_attention_stored", "kv_insert", "topk", "rope", "kv_round", "rms_norm", "compress_decode"):
        assert calls[8][op] == calls[1][op] > 0, (op, calls)
    assert "compress" not in calls[8] and calls[8]["index_scores"] == calls[1]["index_scores"] > 0, calls
    assert calls[8].get("candidate_pool") == calls[1].get("candidate_pool"), calls
