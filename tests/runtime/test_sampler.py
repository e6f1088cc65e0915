"""Sampler: greedy, temperature, top-k, top-p; the draw depends only on (seed, position)."""

from __future__ import annotations

import pytest
import torch

from duotile.runtime.sampler import SamplingParams, filter_logits, gumbel_noise, mix_seed, sample


def _logits(seed=0, vocab=1000):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax():
    x = _logits()
    best = int(x.argmax())
    assert sample(x, SamplingParams(), seed=1, position=5) == best
    for pos in range(20):
        assert sample(x, SamplingParams(temperature=2.0, top_k=1), seed=pos, position=pos) == best
        assert sample(x, SamplingParams(temperature=2.0, top_p=1e-6), seed=pos, position=pos) == best


def test_top_k_and_top_p_restrict_the_support():
    x = _logits(1)
    top5 = set(torch.topk(x, 5).indices.tolist())
    drawn = {sample(x, SamplingParams(temperature=5.0, top_k=5), seed=s, position=0) for s in range(200)}
    assert drawn <= top5 and len(drawn) > 1
    probs = torch.softmax(x.double(), -1)
    order = torch.argsort(probs, descending=True)
    nucleus = set(order[: int((torch.cumsum(probs[order], 0) < 0.5).sum()) + 1].tolist())
    kept = torch.isfinite(filter_logits(x, -1, 0.5)).nonzero().flatten().tolist()
    assert set(kept) == nucleus
    drawn = {sample(x, SamplingParams(temperature=1.0, top_p=0.5), seed=s, position=3) for s in range(200)}
    assert drawn <= nucleus


def test_sampling_follows_the_softmax():
    x = torch.tensor([0.0, 1.0, 2.0, -1.0])
    n = 4000
    counts = torch.bincount(torch.tensor([sample(x, SamplingParams(temperature=1.0), seed=s, position=7)
                                          for s in range(n)]), minlength=4).double()
    expected = torch.softmax(x.double(), -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_noise_is_a_function_of_seed_and_position_only():
    a = gumbel_noise(5, 10, 100)
    assert torch.equal(a, gumbel_noise(5, 10, 100))
    assert not torch.equal(a, gumbel_noise(5, 11, 100)) and not torch.equal(a, gumbel_noise(6, 10, 100))
    assert len({mix_seed(s, p) for s in range(30) for p in range(30)}) == 900
    x = _logits(2)
    params = SamplingParams(temperature=1.0)
    tokens = [sample(x, params, seed=9, position=p) for p in range(40)]
    assert tokens == [sample(x.clone(), params, seed=9, position=p) for p in range(40)]
    assert len(set(tokens)) > 5  # consecutive positions do not draw the same quantile


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5},
                                 {"max_tokens": 0}])
def test_invalid_params_are_rejected(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)
