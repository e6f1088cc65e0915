"""The sampling kernel (kernels_spec/sample.py) on the interpreter: its noise bit for bit the runtime
sampler's (hash words, uniforms, Gumbel values), its tokens the runtime sampler's over many seeds,
positions and temperatures (top-k / top-p masks applied first), greedy ties to the lowest index
across tiles and splits, the same token at every tile and split, and a row's token the same alone
and in any batch.

All of this is bit for bit on the CPU, where the kernel's ``log`` and divide are torch's, the
reference's and the runtime's. On a GPU the noise words and uniforms still agree exactly but
``logf`` may not (kernels_spec/sample.py); ``test_the_draws_are_far_from_ties`` measures how far the
winning score stands above the next one here, the margin a GPU's few-ulp differences would have
to cross to change a token."""

from __future__ import annotations

import pytest
import torch

from duotile import codegen, dsl
from duotile.kernels_spec import load_all
from duotile.kernels_spec import sample as spec_module
from duotile.runtime.sampler import (
    SamplingParams,
    filter_logits,
    gumbel_noise,
    noise_bits,
    sample,
    uniform_of_bits,
)

SPEC = load_all()["sample"]
NEG_INF = float("-inf")


@dsl.kernel
def noise(seed: dsl.Tensor["B", dsl.i64], position: dsl.Tensor["B", dsl.i32], bits: dsl.Tensor["B", "N", dsl.i32],
          w: dsl.Tensor["B", "N", dsl.f32], g: dsl.Tensor["B", "N", dsl.f32]):
    for b, c in dsl.grid(seed.B, dsl.cdiv(bits.N, 256)):
        k0, k1 = spec_module._row_keys(dsl.load(seed[b], (1,)), dsl.load(position[b], (1,)))
        h = spec_module._word(k0[:, None], k1[:, None], c * 256 + dsl.arange(256)[None, :])
        u = spec_module._uniform(h)
        dsl.store(bits[b, c * 256], h)
        dsl.store(w[b, c * 256], u)
        dsl.store(g[b, c * 256], spec_module._gumbel(u))


def run(logits, temperature, seed, position, config=None) -> torch.Tensor:
    token = torch.full((logits.shape[0],), -7, dtype=torch.int32)
    kernel = codegen.compile(SPEC.kernel, "interpret", config=config or {"BV": 256, "SPLIT": 4})
    kernel(logits=logits, temperature=temperature, seed=seed, position=position, token=token)
    return token


def test_the_kernels_noise_is_the_runtimes_bit_for_bit():
    seeds = torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63), 1 << 32, 987654321987654321])
    positions = torch.tensor([0, (1 << 31) - 1, 7, 123456, 1, 0], dtype=torch.int32)
    n = 1500
    bits, w, g = torch.zeros(6, n, dtype=torch.int32), torch.zeros(6, n), torch.zeros(6, n)
    codegen.compile(noise, "interpret")(seed=seeds, position=positions, bits=bits, w=w, g=g)
    want = noise_bits(seeds, positions.long(), n)
    assert torch.equal(bits.long() & 0xFFFFFFFF, want)
    assert torch.equal(w.view(torch.int32), uniform_of_bits(want).view(torch.int32))
    assert torch.equal(g.view(torch.int32), gumbel_noise(seeds, positions.long(), n).view(torch.int32))


def _rows(b: int, n: int, gen: torch.Generator):
    """Logits (a few exact ties and -inf entries), per-row filters, seeds, positions, temperatures."""
    x = torch.randn(b, n, generator=gen) * torch.rand(b, 1, generator=gen) * 6
    x[:, 10:14] = x[:, :4]  # equal logits: ties the noise must split alike on both sides
    x[:, 20::50] = NEG_INF
    temps = torch.tensor([(0.0, 0.3, 0.7, 1.0, 1.5, 4.0)[i % 6] for i in range(b)])
    params = [SamplingParams(temperature=float(t), top_k=(-1, 40, -1, 1)[i % 4], top_p=(1.0, 1.0, 0.8, 0.95)[i % 4])
              for i, t in enumerate(temps)]
    seeds = torch.randint(-(1 << 62), 1 << 62, (b,), generator=gen)
    positions = torch.randint(0, 1 << 20, (b,), generator=gen, dtype=torch.int32)
    return x, params, seeds, positions


def _runtime_tokens(x, params, seeds, positions) -> list[int]:
    return [sample(x[r], params[r], int(seeds[r]), int(positions[r])) for r in range(x.shape[0])]


def _masked_for_kernel(x, params):
    """The runtime's top-k / top-p filter (on logits / T), applied to the raw logits as -inf."""
    out = x.clone()
    for r, p in enumerate(params):
        if p.temperature > 0:
            t = torch.tensor(p.temperature, dtype=torch.float32)
            out[r] = x[r].masked_fill(~torch.isfinite(filter_logits(x[r] / t, p.top_k, p.top_p)), NEG_INF)
    return out


@pytest.mark.parametrize("n,batches", [(3001, 5), (129280, 1)])
def test_the_kernel_picks_the_runtime_samplers_tokens(n, batches):
    """Over many seeds, positions and temperatures (and the runtime's top-k / top-p masks), at a
    ragged vocabulary and at the models' 129,280: every token the same."""
    gen = torch.Generator().manual_seed(n)
    got, want, temps = [], [], []
    for _ in range(batches):
        x, params, seeds, positions = _rows(48 if n < 10000 else 8, n, gen)
        x = torch.where(torch.isfinite(x), x, torch.full_like(x, -1e30))  # the runtime refuses -inf logits
        t = torch.tensor([p.temperature for p in params])
        got += run(_masked_for_kernel(x, params), t, seeds, positions, {"BV": 1024, "SPLIT": 2}).tolist()
        want += _runtime_tokens(x, params, seeds, positions)
        temps += t.tolist()
    assert got == want
    sampled = [tok for tok, t in zip(got, temps) if t > 0]
    assert len(set(sampled)) > len(sampled) // 2  # not vacuous: the draws spread over the vocabulary


def test_the_draws_are_far_from_ties():
    """The margin of each draw above its runner-up, in the reference's FP32 scores: a GPU whose
    ``logf`` differs by a few ulp (scores ~1e-6 apart) changes a token only below it."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, 129280, generator=gen) * 2
    g = gumbel_noise(torch.arange(32) * 7919, torch.arange(32) + 11, 129280)
    top2 = (x + g).topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min()
    assert margin > 1e-4, margin  # 2 orders above the GPU's differences on these 32 rows


def test_greedy_ties_go_to_the_lowest_index_across_tiles_and_splits():
    x = torch.full((4, 3000), -5.0)
    x[0, [2999, 1800, 700, 1024]] = 3.0  # in different tiles and splits: 700 wins
    x[1, :] = 0.0  # all equal: 0
    x[2, :] = NEG_INF  # nothing to sample: -1
    x[3, [5, 2000]] = float("inf")
    zeros, seeds, pos = torch.zeros(4), torch.arange(4), torch.zeros(4, dtype=torch.int32)
    for config in ({"BV": 256, "SPLIT": 1}, {"BV": 256, "SPLIT": 4}, {"BV": 1024, "SPLIT": 16}):
        assert run(x, zeros, seeds, pos, config).tolist() == [700, 0, -1, 5]
    assert run(x, torch.ones(4), seeds, pos).tolist()[2:] == [-1, 5]  # +inf wins whatever the noise


def test_tiles_and_splits_do_not_change_the_token():
    inputs = SPEC.make_inputs({"B": 9, "V": 2500, "values": "ties", "temperature": "mixed"}, torch.device("cpu"), 4)
    args = {k: inputs[k] for k in ("logits", "temperature", "seed", "position")}
    want = SPEC.reference(**args)["token"]
    for config in ({"BV": 256, "SPLIT": 1}, {"BV": 512, "SPLIT": 2}, {"BV": 1024, "SPLIT": 32}):
        assert torch.equal(run(**args, config=config), want), config


def test_a_row_samples_the_same_alone_and_in_any_batch():
    inputs = SPEC.make_inputs({"B": 11, "V": 1200, "values": "normal", "temperature": "mixed"},
                              torch.device("cpu"), 8)
    args = [inputs[k] for k in ("logits", "temperature", "seed", "position")]
    full = run(*args)
    assert torch.equal(full, SPEC.reference(*args)["token"])
    for lo, hi in ((0, 1), (4, 5), (10, 11), (3, 9)):
        assert torch.equal(run(*(a[lo:hi].contiguous() for a in args)), full[lo:hi]), (lo, hi)
    assert torch.equal(run(*(torch.flip(a, [0]).contiguous() for a in args)), torch.flip(full, [0]))


def test_model_shapes_are_decode_batches_at_the_vocabulary():
    shapes = SPEC.model_shapes
    assert len(shapes) == 6 and {c["V"] for c in shapes.values()} == {129280}
    assert sorted({c["B"] for c in shapes.values()}) == [1, 16, 64]
    assert "v41/vocab129280/decode64" in shapes and "v4/vocab129280/decode1" in shapes
