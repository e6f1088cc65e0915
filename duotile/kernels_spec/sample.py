"""Sampling on the device (model.md 2.8: the final head's FP32 logits, V = 129,280 in V4-Flash and
V4.1-Flash, 1.1 / 1.7): for each row of ``logits`` (B x V, f32) with its own ``temperature`` (B,
f32), ``seed`` (B, i64) and ``position`` (B, i32), the token (``token`` B, i32)::

    T == 0 (or below):  argmax(logits)                      greedy
    T > 0:              argmax(logits / T + G(seed, position, i))

ties to the lowest index, -1 for a row whose scores are all -inf (nothing to sample). ``G`` is
Gumbel noise from a counter-based hash of (seed, position, vocabulary index), the runtime
sampler's (duotile/runtime/sampler.py: the hash, the uniform and the Gumbel in its docstring),
computed here in i32 bit operations: a row's draw is a function of its (seed, position) and its
logits only, never of the batch. Top-k / top-p are not applied here: a filter needs the k-th
largest score or a sort of the row (kernels_spec/topk.py's rounds would cost more than the draw);
the caller masks the filtered-out entries to -inf first, as the runtime's ``filter_logits`` does
(on ``logits / T``; the survivors are the same), and this kernel samples from the rest.

The hash in i32 (two's complement: ``*`` and ``+`` wrap, the bits are the unsigned words'): a
logical ``x >> r`` is ``(x >> r) & (2^(32-r) - 1)``, and the constants above 2^31 are written as
the signed values of their bits. The seed's words are ``lo = (s << 32) >> 32`` and ``hi = s >> 32``
(each in i32's range, so the conversion is exact). The vocabulary index enters by an add
(``col + k0``), never times a constant: TIR folds a constant times an index expression into
the loop's strides, and TileLang 0.1.15 fails on products outside int32 (docs/dsl.md).

What agrees bit for bit, and where: the hash words are integer operations, the same on every
target. The uniform ``w`` comes from them by IEEE operations each rounded once (``(h >> 8) *
2^-24`` and ``((h & 255) + 0.5) * 2^-32`` are exact, an FMA contraction of their sum gives the
same sum, which rounds once), so ``w`` is the same on every target too. ``log`` is not: the
interpreter and the reference both take torch's CPU ``log``, so there the noise, the scores and
the tokens are bit for bit the reference's (the tests compare tokens exactly, and the noise
itself in tests/kernels_spec/test_sample.py); a GPU's ``logf`` differs from it by an ulp or so
(the CUDA builds divide and convert in IEEE, without fast math, so ``x / T`` agrees). Two scores
of a row within a few ulp (~1e-6) of each other can then pick different tokens on a GPU than on
the CPU: the top two scores of a row are that close in of order one row in 10^5 to 10^6 (their
gap is of order 1 with continuous logits). Greedy rows (no log, no divide) agree exactly, but
for subnormal logits, which the CUDA builds flush to zero (``--ftz``).

Two phases (``SPLIT > 1``): grid (B, SPLIT): block (b, s) walks its ``cdiv(cdiv(V, BV), SPLIT)``
tiles of BV scores (past V read -inf) keeping, per lane, the best score and its index (strictly
greater replaces, so the earlier, lower index stays on a tie); then the lane maximum and the
lowest index holding it go to the workspaces. Grid (B,): the same choice over the SPLIT partials
(the lowest index among the equal best). ``SPLIT == 1`` is one grid. A max and a min are exact,
so every BV and SPLIT gives the same token. Indices are carried as f32 (exact below 2^24 > V).

Decode path: each row is sampled on its own (``B`` is the batch dimension, dynamic); V is
specialised. A NaN logit or temperature has an unspecified token.
"""

from __future__ import annotations

import torch

from .. import dsl
from ..runtime.sampler import gumbel_noise
from . import model_shapes as shapes
from .registry import Dim, OneOf, Spec, register

NEG_INF = float("-inf")
BIG = float(1 << 24)  # the index of "none yet": above every real index (V < 2^24), exact in f32
M1, M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers (M2 as the signed value)
GOLDEN, K1_SALT = 0x9E3779B9 - (1 << 32), 0x5BD1E995


def _shr(x, r: int):
    """Logical right shift of i32 words."""
    return (x >> r) & ((1 << (32 - r)) - 1)


def _fmix(x):
    """lowbias32: a bijection of 32-bit words."""
    x = x ^ _shr(x, 16)
    x = x * M1
    x = x ^ _shr(x, 15)
    x = x * M2
    return x ^ _shr(x, 16)


def _row_keys(s, p):
    """The row keys (k0, k1) of a seed ``s`` (i64) and position ``p`` (i32), one-element tiles."""
    lo, hi = ((s << 32) >> 32).to(dsl.i32), (s >> 32).to(dsl.i32)
    k0 = _fmix(_fmix(lo ^ _fmix(hi)) + p)
    k1 = _fmix(_fmix(hi ^ _fmix(lo ^ K1_SALT)) + p * GOLDEN)
    return k0, k1


def _word(k0, k1, col):
    """The hash word of vocabulary indices ``col`` (an i32 tile) under the row keys."""
    return _fmix(_fmix(col + k0) ^ k1)


def _uniform(h):
    """w in (0, 1), f32: (h + 1/2) 2^-32 (h unsigned) rounded once, at most 1 - 2^-24."""
    w = ((h >> 8) & 0xFFFFFF).to(dsl.f32) * 2.0 ** -24 + ((h & 0xFF).to(dsl.f32) + 0.5) * 2.0 ** -32
    return dsl.minimum(w, 1.0 - 2.0 ** -24)


def _gumbel(w):
    """-log(-log1p(-w)), log1p in its compensated form."""
    v = 1.0 - w
    return -dsl.log(-(dsl.log(v) + (-w - (v - 1.0)) / v))


def _best_of_split(logits, temperature, seed, position, b, s, span, BV):
    """The best score of tiles ``s * span ..`` of row ``b`` and the lowest index holding it (1,)."""
    t = dsl.load(temperature[b], (1,))[:, None]
    k0, k1 = _row_keys(dsl.load(seed[b], (1,)), dsl.load(position[b], (1,)))
    best = dsl.full((1, BV), NEG_INF, dsl.f32)
    at = dsl.full((1, BV), BIG, dsl.f32)
    for j in dsl.range(span):
        start = (s * span + j) * BV
        col = start + dsl.arange(BV)[None, :]
        x = dsl.load(logits[b, start], (1, BV), other=NEG_INF)
        score = dsl.where(t > 0.0, x / t + _gumbel(_uniform(_word(k0[:, None], k1[:, None], col))), x)
        at[:] = dsl.where(score > best, col.to(dsl.f32), at)
        best[:] = dsl.maximum(score, best)
    top = best.max(axis=1)
    return top, dsl.where(best.eq(top[:, None]), at, BIG).min(axis=1)


@dsl.kernel(batch_dim="B", dynamic=("B",))
def sample(logits: dsl.Tensor["B", "V", dsl.f32], temperature: dsl.Tensor["B", dsl.f32],
           seed: dsl.Tensor["B", dsl.i64], position: dsl.Tensor["B", dsl.i32],
           token: dsl.Tensor["B", dsl.i32], *,
           BV: dsl.Tunable = dsl.choice(1024, 256, 512, 2048),
           SPLIT: dsl.Tunable = dsl.choice(16, 1, 2, 4, 8, 32)):
    span = dsl.cdiv(dsl.cdiv(logits.V, BV), SPLIT)  # tiles a block walks
    if SPLIT == 1:
        for b in dsl.grid(logits.B):
            top, at = _best_of_split(logits, temperature, seed, position, b, 0, span, BV)
            dsl.store(token[b], dsl.where(top > NEG_INF, at, -1.0).to(dsl.i32))
        return
    part_v = dsl.workspace("part_v", (logits.B, SPLIT), dsl.f32)
    part_i = dsl.workspace("part_i", (logits.B, SPLIT), dsl.f32)
    for b, s in dsl.grid(logits.B, SPLIT):
        top, at = _best_of_split(logits, temperature, seed, position, b, s, span, BV)
        dsl.store(part_v[b, s], top)
        dsl.store(part_i[b, s], at)
    for b in dsl.grid(logits.B):
        v = dsl.load(part_v[b, 0], (1, SPLIT))
        i = dsl.load(part_i[b, 0], (1, SPLIT))
        top = v.max(axis=1)
        at = dsl.where(v.eq(top[:, None]), i, BIG).min(axis=1)
        dsl.store(token[b], dsl.where(top > NEG_INF, at, -1.0).to(dsl.i32))


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                     position: torch.Tensor) -> dict:
    """Per row: argmax of logits (T <= 0) or of logits / T + the runtime sampler's Gumbel noise of
    (seed, position) (T > 0), in FP32; the first index of the maximum; -1 where every score is -inf."""
    x = logits.float().cpu()
    t = temperature.float().cpu()[:, None]
    rows, n = x.shape
    if n == 0:
        return {"token": torch.full((rows,), -1, dtype=torch.int32)}
    g = gumbel_noise(seed.cpu().long(), position.cpu().long(), n).reshape(rows, n)
    score = torch.where(t > 0, x / t + g, x)
    best = score.argmax(-1)
    live = score.max(-1).values > NEG_INF
    return {"token": torch.where(live, best, -1).to(torch.int32).to(logits.device)}


def _logits(kind: str, b: int, n: int, g: torch.Generator) -> torch.Tensor:
    """Logits of one kind: ``normal`` (N(0, 3^2)), ``ties`` (five values: most rows tie at the top),
    ``masked`` (N(0, 3^2), a third of the entries -inf anywhere and every fourth row all -inf,
    as top-k / top-p filters leave them), ``peaked`` (one entry 30 above the rest),
    ``extreme`` (magnitudes 2^-60 .. 2^60 of either sign, a few -inf, in every other row +inf)."""
    x = torch.randn(b, n, generator=g) * 3.0
    if kind == "normal":
        return x
    if kind == "ties":
        return torch.randint(-2, 3, (b, n), generator=g).float() * 0.5
    if kind == "masked":
        x = x.masked_fill(torch.rand(b, n, generator=g) < 1 / 3, NEG_INF)
        x[::4] = NEG_INF
        return x
    if kind == "peaked":
        x[torch.arange(b), torch.randint(0, n, (b,), generator=g)] += 30.0
        return x
    if kind == "extreme":
        x = torch.sign(x) * torch.exp2(torch.randint(-60, 61, (b, n), generator=g).float())
        x[::2, 3::97] = float("inf")  # every other row: +inf entries win, the lowest first
        x[:, 5::13] = NEG_INF
        return x
    raise ValueError(f"unknown logits kind {kind!r}")


TEMPERATURES = (0.0, 1.0, 0.7, 2.0, 1e-3, 0.0, 5.0)  # "mixed" cycles through these


def _temperatures(kind, b: int, g: torch.Generator) -> torch.Tensor:
    """``mixed`` (greedy and sampled rows, cold to hot), ``zero`` (all greedy), ``random`` (each
    row uniform in (0, 3)), or one temperature for every row."""
    if kind == "mixed":
        return torch.tensor([TEMPERATURES[r % len(TEMPERATURES)] for r in range(b)])
    if kind == "zero":
        return torch.zeros(b)
    if kind == "random":
        return torch.rand(b, generator=g) * 3.0 + 1e-3
    return torch.full((b,), float(kind))


EDGE_SEEDS = (0, -1, (1 << 63) - 1, -(1 << 63), 1 << 32, (1 << 32) - 1)


def _seeds(kind: str, b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(seed, position) of each row: ``random`` (63-bit seeds, positions below 2^20), ``edge``
    (seeds at the words' edges, positions 0 and 2^31 - 1), ``same`` (one seed, consecutive
    positions: one request's steps)."""
    if kind == "random":
        return (torch.randint(0, 1 << 62, (b,), generator=g) * 2 + torch.randint(0, 2, (b,), generator=g),
                torch.randint(0, 1 << 20, (b,), generator=g))
    if kind == "edge":
        return (torch.tensor([EDGE_SEEDS[r % len(EDGE_SEEDS)] for r in range(b)]),
                torch.tensor([(0, (1 << 31) - 1)[r % 2] for r in range(b)]))
    if kind == "same":
        return torch.full((b,), 12345), torch.arange(b) + 100
    raise ValueError(f"unknown seed kind {kind!r}")


def _inputs(case, device, seed):
    b, n = case["B"], case["V"]
    out = {"token": torch.full((b,), -7, dtype=torch.int32, device=device)}
    if device.type == "meta":
        return {"logits": torch.empty(b, n), "temperature": torch.empty(b),
                "seed": torch.empty(b, dtype=torch.int64), "position": torch.empty(b, dtype=torch.int32), **out}
    g = torch.Generator().manual_seed(seed)
    x = _logits(case.get("values", "normal"), b, n, g)
    t = _temperatures(case.get("temperature", "mixed"), b, g)
    s, p = _seeds(case.get("seeds", "random"), b, g)
    return {"logits": x.to(device), "temperature": t.to(device), "seed": s.to(torch.int64).to(device),
            "position": p.to(torch.int32).to(device), **out}


def sample_shapes(m: shapes.ModelDims) -> dict[str, shapes.Case]:
    """One logits row per sequence at the model's vocabulary, decode batches 1, 16 and 64 (one
    build serves every batch, B is dynamic, so the batches between add nothing to build)."""
    return {f"{m.short}/vocab{m.vocab}/decode{b}": {"B": b, "V": m.vocab, "model": m.name}
            for b in shapes.DECODE_SAMPLE}


SMALL = {"BV": 256, "SPLIT": 4}
SPEC = register(Spec(
    kernel=sample,
    reference=sample_reference,
    make_inputs=_inputs,
    outputs=("token",),
    cases={
        "mixed_b7_v1000": {"B": 7, "V": 1000, "config": SMALL},
        "ties_b6_v777": {"B": 6, "V": 777, "values": "ties", "config": {"BV": 256, "SPLIT": 2}},
        "greedy_ties_b4_v300": {"B": 4, "V": 300, "values": "ties", "temperature": "zero",
                                "config": {"BV": 256, "SPLIT": 1}},
        "masked_b8_v513": {"B": 8, "V": 513, "values": "masked", "config": SMALL},
        "peaked_b5_v2000": {"B": 5, "V": 2000, "values": "peaked", "temperature": "random", "config": SMALL},
        "extreme_b6_v1111": {"B": 6, "V": 1111, "values": "extreme", "seeds": "edge",
                             "config": {"BV": 512, "SPLIT": 8}},
        "one_request_b9_v400": {"B": 9, "V": 400, "temperature": "1.0", "seeds": "same", "config": SMALL},
        "short_b3_v5": {"B": 3, "V": 5, "config": {"BV": 256, "SPLIT": 2}},  # fewer entries than a tile
        "vocab_b2": {"B": 2, "V": 129280, "config": {"BV": 2048, "SPLIT": 8}},  # the models' vocabulary
    },
    build_cases={"decode64": {"B": 64, "V": 129280}},
    tolerance=lambda case, out: (0.0, 0.0),
    exact=True,
    # the hash (about 40 integer operations), two logs, a divide and the compare-select an entry
    flops=lambda c: 50.0 * c["B"] * c["V"],
    bytes_moved=lambda c: 4.0 * c["B"] * (c["V"] + 5),
    model_shapes=shapes.for_models(sample_shapes),
    sweep={"B": Dim(1, 9, large=64), "V": Dim(1, 3000, large=129280),
           "values": OneOf("normal", "ties", "masked", "peaked", "extreme"),
           "temperature": OneOf("mixed", "zero", "random", "1.0"),
           "seeds": OneOf("random", "edge", "same"),
           "config": {"BV": OneOf(256, 512, 1024), "SPLIT": OneOf(1, 2, 4, 16)}},
))
