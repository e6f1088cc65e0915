"""Requests and continuous-batching scheduling with chunked prefill (vLLM's Sequence / Scheduler).

Every step the scheduler gives each running request in decode one token, then spends the remaining
token budget (`max_num_batched_tokens`) on prompt chunks - first of requests already prefilling, then
of newly admitted ones while fewer than `max_num_seqs` run. A prompt chunk is at most
`prefill_chunk_size` tokens. Finished requests leave at once and free their slot for the next step.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from .cache import SequenceCache
from .sampler import SamplingParams


@dataclass
class Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    cache: SequenceCache | None = None
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_computed(self) -> int:
        return self.cache.num_tokens if self.cache is not None else 0

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk_size: int | None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.chunk = prefill_chunk_size or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, new_cache) -> list[tuple[Sequence, int]]:
        """(sequence, number of new tokens) for this step; `new_cache()` makes a cache for an admitted one."""
        batch, budget = [], self.budget
        for seq in self.running:
            if not seq.prefilling and budget:
                batch.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if seq.prefilling and budget:
                n = min(len(seq.prompt) - seq.num_computed, budget, self.chunk)
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.cache = new_cache()
            self.running.append(seq)
            n = min(len(seq.prompt), budget, self.chunk)
            batch.append((seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.running.remove(seq)
