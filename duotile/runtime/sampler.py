"""Seeded, batch-independent sampling: greedy, temperature, top-k, top-p.

Each request is sampled from its own FP32 logits row, alone. The randomness is Gumbel-max noise drawn
from a `torch.Generator` seeded with a 64-bit mix of (request seed, token position), one uniform per
vocabulary entry in vocabulary order. So the draw for a token depends only on (seed, position) and the
request's logits - never on the batch, the step it was scheduled in, or other requests. Taking
`argmax(logits / T + Gumbel)` over the top-k / top-p survivors samples exactly from the filtered
softmax. Temperature 0 is greedy (argmax, lowest index on ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


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


def mix_seed(seed: int, position: int) -> int:
    """SplitMix64 finaliser of (seed, position): a well-spread 63-bit generator seed."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def gumbel_noise(seed: int, position: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(mix_seed(seed, position))
    u = torch.rand(vocab, generator=g, dtype=torch.float64)
    return (-torch.log(-torch.log(u))).float()  # u = 0 gives -inf (never picked); u < 1 keeps it finite


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
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    return int(torch.argmax(scaled + gumbel_noise(seed, position, logits.shape[-1])))
