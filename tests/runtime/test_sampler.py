"""Sampler: greedy, temperature, top-k, top-p; the draw depends only on (seed, position), through a
counter-based hash whose words, uniforms and Gumbel values are pinned here (the ``sample`` kernel
computes the same: tests/kernels_spec/test_sample.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from duotile.runtime.sampler import (
    SamplingParams,
    filter_logits,
    gumbel_noise,
    noise_bits,
    row_keys,
    sample,
    uniform_of_bits,
)


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


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_sampling_follows_the_softmax(over):
    """Across requests (seeds at one position) and across one request's steps (positions)."""
    x = torch.tensor([0.0, 1.0, 2.0, -1.0])
    n = 4000
    draws = [(s, 7) if over == "seeds" else (7, s) for s in range(n)]
    counts = torch.bincount(torch.tensor([sample(x, SamplingParams(temperature=1.0), seed=s, position=p)
                                          for s, p in draws]), minlength=4).double()
    expected = torch.softmax(x.double(), -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


def test_noise_is_a_function_of_seed_and_position_only():
    a = gumbel_noise(5, 10, 100)
    assert torch.equal(a, gumbel_noise(5, 10, 100))
    assert not torch.equal(a, gumbel_noise(5, 11, 100)) and not torch.equal(a, gumbel_noise(6, 10, 100))
    seeds, positions = torch.arange(30).repeat_interleave(30), torch.arange(30).repeat(30)
    k0, k1 = row_keys(seeds, positions)
    assert len(set(zip(k0.tolist(), k1.tolist()))) == 900
    assert len(set(row_keys(3, torch.arange(20000))[0].tolist())) == 20000  # one request: a key per position
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


M32 = (1 << 32) - 1


def _fmix(x: int) -> int:
    x ^= x >> 16
    x = x * 0x7FEB352D & M32
    x ^= x >> 15
    x = x * 0x846CA68B & M32
    return x ^ (x >> 16)


def _word(seed: int, position: int, i: int) -> int:
    """The hash word of the sampler's docstring, in Python ints."""
    lo, hi, p = seed & M32, (seed >> 32) & M32, position & M32
    k0 = _fmix((_fmix(lo ^ _fmix(hi)) + p) & M32)
    k1 = _fmix((_fmix(hi ^ _fmix(lo ^ 0x5BD1E995)) + p * 0x9E3779B9) & M32)
    return _fmix(_fmix((i + k0) & M32) ^ k1)


def test_the_noise_words_are_the_documented_hash():
    rng = random.Random(3)
    for seed in (0, 1, -1, (1 << 63) - 1, -(1 << 63), *(rng.getrandbits(64) for _ in range(6))):
        position = rng.getrandbits(31)
        got = noise_bits(seed, position, 300)[0].tolist()
        assert got == [_word(seed, position, i) for i in range(300)], seed
    assert torch.equal(gumbel_noise(-1, 4, 50), gumbel_noise((1 << 64) - 1, 4, 50))  # the seed mod 2^64
    assert torch.equal(gumbel_noise(5, 4, 50), gumbel_noise(5 + (1 << 64), 4, 50))
    # pinned: a change of the hash changes every seeded draw (and must change the kernel with it)
    assert noise_bits(0, 0, 3)[0].tolist() == [_word(0, 0, i) for i in range(3)] == [1633286182, 2039418246,
                                                                                        671060521]


def test_the_uniform_is_the_word_plus_a_half_rounded_once_and_never_0_or_1():
    h = torch.cat([torch.arange(0, 1 << 12), torch.randint(0, 1 << 32, (1 << 16,),
                                                          generator=torch.Generator().manual_seed(0)),
                   torch.arange((1 << 32) - 300, 1 << 32)])
    w = uniform_of_bits(h)
    exact = ((h.double() + 0.5) * 2.0 ** -32).float()  # the real value rounded once to FP32
    assert torch.equal(w, torch.clamp(exact, max=1.0 - 2.0 ** -24))
    small = h < 1 << 23  # w < 2^-9: exact, every one of the 32 bits kept
    assert torch.equal(w[small].double(), (h[small].double() + 0.5) * 2.0 ** -32)
    assert w.min() == 2.0 ** -33 and w.max() == 1.0 - 2.0 ** -24
    assert bool(torch.isfinite(gumbel_noise(0, 0, 1 << 16)).all())


def test_the_noise_is_gumbel_distributed():
    """Over 2^20 entries of one row: the mean (Euler's gamma) and variance (pi^2 / 6) of a Gumbel,
    and w's 16 top-bit bins flat (chi-square, 15 degrees of freedom, p = 0.001)."""
    g = gumbel_noise(2026, 12, 1 << 20).double()
    assert abs(g.mean() - 0.5772157) < 0.005 and abs(g.var() - math.pi ** 2 / 6) < 0.01
    counts = torch.bincount(noise_bits(2026, 12, 1 << 20)[0] >> 28, minlength=16).double()
    assert ((counts - 65536) ** 2 / 65536).sum() < 37.7
    for a, b in (((2026, 12), (2026, 13)), ((2026, 12), (2027, 12)), ((0, 0), (1 << 32, 0))):
        pair = torch.stack([gumbel_noise(*a, 1 << 16), gumbel_noise(*b, 1 << 16)]).double()
        assert abs(torch.corrcoef(pair)[0, 1]) < 0.02, (a, b)  # neighbouring keys: unrelated rows
