"""A compressor's carried state in its two forms (runtime/cache.py): the reference's lists and the
kernels' banks, converted either way at any point of a sequence; a decode step's pooling of every
sequence at once (``pool_all``) on the interpreted kernels against the reference."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from duotile.runtime.cache import CompressorState
from duotile.runtime.generated import GeneratedOps
from duotile.runtime.layers.common import Ctx
from duotile.runtime.layers.compressor import pool_all, pool_windows
from duotile.runtime.ops import FastOps

# (ratio, overlap, width): V4's CSA form (overlapping, A | B halves), V4.1's ratio 2, a longer window
FORMS = [(4, True, 16), (2, False, 8), (8, False, 8)]


def _lists(st):
    return [t.clone() if t is not None else None for t in (st.pending_c, st.pending_z, st.prev_c, st.prev_z)]


def _equal(a, b) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


@pytest.mark.parametrize("ratio,overlap,width", FORMS)
@pytest.mark.parametrize("n", [0, 1, 5, 9, 16])
def test_lists_to_banks_and_back_is_exact(ratio, overlap, width, n):
    g = torch.Generator().manual_seed(n)
    st = CompressorState.empty(width, "cpu")
    pool_windows(Ctx(FastOps()), st, torch.randn(n, width, generator=g), torch.randn(n, width, generator=g), 0,
                 ratio, overlap)
    before = _lists(st)
    c, z = st.as_banks(n, ratio, overlap)
    assert c.shape == z.shape == ((2 if overlap else 1) * ratio, width) and st.pending_c is None
    st.as_lists(n, ratio, overlap)
    assert st.banked is None and _equal(_lists(st), before)


def _step(ctx, states, seqs, width, g):
    t = sum(sl.stop - sl.start for _, sl in seqs)
    c, z = torch.randn(t, width, generator=g), torch.randn(t, width, generator=g)
    return pool_all(ctx, states, c, z, seqs, *ctx.form)


def _seqs(starts, counts):
    out, at = [], 0
    for s, n in zip(starts, counts):
        out.append((SimpleNamespace(start=s), slice(at, at + n)))
        at += n
    return out


@pytest.mark.parametrize("ratio,overlap,width", FORMS)
def test_decode_steps_on_the_kernels_pool_as_the_reference(ratio, overlap, width):
    """Three sequences prefilled on the reference (prompts of different lengths), then decode
    steps on the interpreted kernels (one launch a step for all) beside the same steps on the
    reference: the same rows (FP32 pooling in another order), positions and counts, in any order
    of the sequences and with one of them sitting a step out; the states end alike."""
    ref, gen = Ctx(FastOps()), Ctx(GeneratedOps(FastOps()))
    ref.form = gen.form = (ratio, overlap)
    g = torch.Generator().manual_seed(ratio)
    lengths = [3, ratio * 2 + 1, 1]
    ref_states = [CompressorState.empty(width, "cpu") for _ in lengths]
    _step(ref, ref_states, _seqs([0, 0, 0], lengths), width, g)
    gen_states = copy.deepcopy(ref_states)
    starts = list(lengths)
    orders = [[0, 1, 2]] * (ratio + 1) + [[2, 0, 1], [1, 2]] + [[0, 1, 2]] * ratio
    for order in orders:
        seqs = _seqs([starts[i] for i in order], [1] * len(order))
        seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
        want = _step(ref, [ref_states[i] for i in order], seqs, width, torch.Generator().manual_seed(seed))
        got = _step(gen, [gen_states[i] for i in order], seqs, width, torch.Generator().manual_seed(seed))
        assert got[2] == want[2] and torch.equal(got[1], want[1])
        assert got[0].shape == want[0].shape and torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
        for i in order:
            starts[i] += 1
    assert gen.tally.calls["compress_decode"] == [len(orders), 0]
    for a, b, n in zip(gen_states, ref_states, starts):
        a.as_lists(n, ratio, overlap)
        b.as_lists(n, ratio, overlap)
        assert _equal(_lists(a), _lists(b))
