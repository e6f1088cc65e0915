"""What one forward step is made of: several sequences, each with a chunk of new tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache import SequenceCache
from ..device import ship


@dataclass
class StepSeq:
    """One sequence's part of a step: its cache and its new tokens at positions start .. start+S-1."""

    cache: SequenceCache
    tokens: torch.Tensor
    scratch: dict = field(default_factory=dict)  # per-step state shared between layers (V4.1 top-k, pools)

    @property
    def start(self) -> int:
        return self.cache.num_tokens


@dataclass
class Step:
    seqs: list[StepSeq]
    tokens: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    slices: list[slice] = field(init=False)

    def device_tokens(self, device: torch.device) -> torch.Tensor:
        """The step's tokens on ``device``, shipped once a step (the hash-routed layers read them)."""
        if self._device_tokens is None or self._device_tokens.device != device:
            self._device_tokens = ship(self.tokens, device)
        return self._device_tokens

    def __post_init__(self) -> None:
        self._device_tokens = None
        self.tokens = torch.cat([s.tokens.long().cpu() for s in self.seqs])
        self.positions = torch.cat([torch.arange(s.start, s.start + len(s.tokens)) for s in self.seqs])
        self.slices, at = [], 0
        for s in self.seqs:
            self.slices.append(slice(at, at + len(s.tokens)))
            at += len(s.tokens)


def one_token_each(seqs: list) -> bool:
    """Whether a step's ``(StepSeq, slice)`` pairs bring one token each (a decode step): its cache
    work runs once for all sequences, on stacked caches (``stacked.py``)."""
    return all(sl.stop - sl.start == 1 for _, sl in seqs)
