"""Seeded, batch-independent sampling: greedy, temperature, top-k, top-p.

Each request is sampled from its own FP32 logits row, alone. The randomness is Gumbel-max noise from a
counter-based hash of (request seed, token position, vocabulary index): no generator state, so the
draw for a token depends only on (seed, position) and the request's logits - never on the batch, the
step it was scheduled in, or other requests - and a kernel computes the same noise from the same three
integers (the ``sample`` kernel spec, kernels_spec/sample.py, bit for bit on its interpreter). Taking
`argmax(logits / T + Gumbel)` over the top-k / top-p survivors samples from the filtered softmax.
Temperature 0 is greedy (argmax, lowest index on ties).

The noise, in unsigned 32-bit words (every product and sum mod 2^32; ``fmix`` is the lowbias32
finaliser, x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16, a bijection)::

    lo, hi = the low and high words of the seed (mod 2^64), p = the position (mod 2^32)
    k0 = fmix(fmix(lo ^ fmix(hi)) + p)                      # both row keys are bijections of p
    k1 = fmix(fmix(hi ^ fmix(lo ^ 0x5BD1E995)) + p * 0x9E3779B9)
    h  = fmix(fmix(i + k0) ^ k1)                            # vocabulary index i: a bijection of i

then in FP32, each step correctly rounded (so any IEEE machine gets the same ``w``)::

    w = min((h >> 8) * 2^-24 + ((h & 255) + 0.5) * 2^-32, 1 - 2^-24)     # uniform in (0, 1)
    E = -log1p(-w)     as  -(log(v) + ((-w) - (v - 1)) / v),  v = 1 - w   # exponential
    G = -log(E)                                                             # Gumbel

``w`` is (h + 1/2) 2^-32 rounded once to FP32: exact below 2^-9, where the winners lie (the
largest G has the smallest E = w + O(w^2)), so the tail that decides the draw keeps 32 bits of
resolution; a uniform formed near 1 would keep only FP32's 24 (2^-24 steps in E at E ~ 1e-5, a
1 % quantisation of the winner's noise over 129,280 entries). The clamp keeps the 2^-25 of words
that round to 1 finite (G >= -2.81). log1p is written out (Fast2Sum: ``(-w) - (v - 1)`` is the
rounding error of ``1 - w``), as in kernels_spec/router.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names)."""

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k: must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        self.stop_token_ids = tuple(self.stop_token_ids)


_MASK32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for words x in int64, in 16-bit halves of c: no product leaves int64."""
    return (x * (c & 0xFFFF) + ((x * (c >> 16)) << 16)) & _MASK32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons), a bijection of 32-bit words held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _words(v) -> torch.Tensor:
    """Ints (mod 2^64, as signed int64) or an int tensor, as a 1-D int64 tensor."""
    if isinstance(v, int):
        v = (v + (1 << 63)) % (1 << 64) - (1 << 63)
    return torch.as_tensor(v, dtype=torch.int64).reshape(-1)


def row_keys(seed, position) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit keys (k0, k1) of each (seed, position): ints or int64 tensors (one per row)."""
    s, p = _words(seed), _words(position) & _MASK32
    lo, hi = s & _MASK32, (s >> 32) & _MASK32
    k0 = fmix32((fmix32(lo ^ fmix32(hi)) + p) & _MASK32)
    k1 = fmix32((fmix32(hi ^ fmix32(lo ^ 0x5BD1E995)) + _mul32(p, _GOLDEN)) & _MASK32)
    return k0, k1


def noise_bits(seed, position, vocab: int) -> torch.Tensor:
    """The 32-bit word h of every vocabulary index, [rows, vocab] int64 (rows: one per seed)."""
    k0, k1 = row_keys(seed, position)
    i = torch.arange(vocab, dtype=torch.int64, device=k0.device)[None, :]
    return fmix32(fmix32((i + k0[:, None]) & _MASK32) ^ k1[:, None])


def uniform_of_bits(h: torch.Tensor) -> torch.Tensor:
    """w in (0, 1), FP32: (h + 1/2) 2^-32 rounded once, at most 1 - 2^-24."""
    w = (h >> 8).float() * 2.0 ** -24 + ((h & 255).float() + 0.5) * 2.0 ** -32
    return torch.clamp(w, max=1.0 - 2.0 ** -24)


def gumbel_of_uniform(w: torch.Tensor) -> torch.Tensor:
    """-log(-log1p(-w)) in FP32, log1p in its compensated form."""
    v = 1.0 - w
    e = -(torch.log(v) + ((-w) - (v - 1.0)) / v)
    return -torch.log(e)


def gumbel_noise(seed, position, vocab: int) -> torch.Tensor:
    """Gumbel noise for one (seed, position) as [vocab] FP32, or for rows of seeds and positions
    (equal-length int tensors) as [rows, vocab]."""
    g = gumbel_of_uniform(uniform_of_bits(noise_bits(seed, position, vocab)))
    return g[0] if isinstance(seed, int) and isinstance(position, int) else g


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf outside the top-k and outside the smallest top-p nucleus (sorted by logit, ties by index)."""
    order = torch.sort(logits, descending=True, stable=True).indices
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k != -1:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        sorted_logits = logits[order].masked_fill(~keep[order], float("-inf"))
        probs = torch.softmax(sorted_logits.double(), -1)
        before = torch.cumsum(probs, -1) - probs  # mass strictly before each candidate
        keep[order[before >= top_p]] = False
    return logits.masked_fill(~keep, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """One token id from one request's FP32 logits [V] for the token at `position`."""
    logits = logits.float().cpu()
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"logits: not all finite at position {position} "
                         f"({int(torch.isnan(logits).sum())} NaN of {logits.numel()}); refusing to sample")
    t = torch.tensor(params.temperature, dtype=torch.float32)  # T as FP32, as a kernel receives it
    if t == 0:  # greedy (also a T that FP32 holds as 0)
        return int(torch.argmax(logits))
    scaled = filter_logits(logits / t, params.top_k, params.top_p)
    return int(torch.argmax(scaled + gumbel_noise(seed, position, logits.shape[-1])))
