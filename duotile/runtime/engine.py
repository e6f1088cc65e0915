"""The offline engine: `LLM(model).generate(prompt_token_ids, SamplingParams)` (vLLM's API and names).

`LLMEngine.step()` = schedule (continuous batching, chunked prefill; scheduler.py) -> one reference
forward over every scheduled chunk (reference.py) -> sample the requests whose prompt is complete
(sampler.py) -> retire finished requests. In batch-invariant mode (`batch_invariant=True`) the model
runs on `InvariantOps` (ops.py): every per-token computation is row-wise with a fixed reduction order,
so a request's logits and tokens are bitwise the same whatever it is batched with, in whatever order,
and however its prompt is chunked. Sampling is per request and keyed by (seed, position) anyway.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .cache import CacheBytes, format_bytes
from .device import resolve_device
from .footprint import check_fits
from .layers.step import StepSeq
from .loader import open_model
from .model_ops import model_op
from .presets import DEFAULT_PRESET
from .reference import Model, check_dtype
from .sampler import SamplingParams, sample
from .scheduler import Scheduler, Sequence


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    cache_bytes: CacheBytes
    allocated_cache_bytes: int
    logits: list[torch.Tensor] | None = None
    error: str | None = None  # set when finish_reason is "error": why the request was failed


class GenerationError(RuntimeError):
    """A request failed (non-finite logits); `outputs` holds every request's output, the failed ones marked."""

    def __init__(self, message: str, outputs: list[RequestOutput]):
        super().__init__(message)
        self.outputs = outputs


@dataclass
class GenerateStats:
    prompt_tokens: int
    generated_tokens: int
    steps: int
    seconds: float
    cache_bytes: int  # production-format bytes of all requests' state at their end (model.md 3)
    ops: dict[str, tuple[int, int]] | None = None  # per model op: (generated, reference) calls (model_ops.py)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else float("inf")


class LLMEngine:
    def __init__(self, model: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.bfloat16,
                 batch_invariant: bool = False, quant: bool = True, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 256, prefill_chunk_size: int | None = None,
                 device: str = "cpu", seed: int = 0, kernels: str = "reference", fp8_wo_a: bool = False,
                 graphs: bool = False):
        check_dtype(dtype)
        device = resolve_device(device)
        self.checkpoint = open_model(model or DEFAULT_PRESET)
        self.config = self.checkpoint.config
        check_fits(self.config, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, batch_invariant=batch_invariant)
        self.model = Model(self.checkpoint, dtype=dtype, quant=quant, batch_invariant=batch_invariant,
                           device=device, kernels=kernels, fp8_wo_a=fp8_wo_a, graphs=graphs)
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, prefill_chunk_size)
        self._rng = random.Random(seed)
        self.last_stats: GenerateStats | None = None

    def add_request(self, prompt: list[int], params: SamplingParams) -> Sequence:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt_token_ids: a prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(self.scheduler.next_id(), prompt, params, seed)
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        """One forward step; returns the requests that finished in it."""
        batch = self.scheduler.schedule(self.model.new_cache)
        if not batch:
            return []
        chunks = [StepSeq(seq.cache, torch.tensor(seq.tokens[seq.num_computed : seq.num_computed + n]))
                  for seq, n in batch]
        logits = self.model.forward(chunks)
        decode = [(seq, row) for (seq, _), row in zip(batch, logits) if not seq.prefilling]
        if not decode:
            return []
        rows = torch.stack([row for _, row in decode])
        finite = torch.isfinite(rows).all(dim=1).tolist()  # one host sync for the batch
        finished, live = [], []
        for (seq, row), ok in zip(decode, finite):
            if ok:
                live.append(seq)
                continue
            seq.error = (f"request {seq.request_id}: {_non_finite(row)} in the logits for position "
                         f"{len(seq.tokens)} (after {len(seq.output)} generated tokens); not sampled")
            self.scheduler.finish(seq, "error")
            finished.append(seq)
        keep = [i for i, ok in enumerate(finite) if ok]
        tokens = sample_tokens(self.model.ctx, rows[keep] if len(keep) < len(decode) else rows,
                               [seq.params for seq in live], [seq.seed for seq in live],
                               [len(seq.tokens) for seq in live]) if live else []
        for seq, token, i in zip(live, tokens, keep):
            seq.output.append(token)
            if seq.params.return_logits:
                seq.logits.append(rows[i].float().cpu().clone())
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.params.stop_token_ids or (token == self.config.eos_token_id and not seq.params.ignore_eos):
            return "stop"
        return "length" if len(seq.output) >= seq.params.max_tokens else None

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt, list(seq.output), seq.finish_reason or "",
                             format_bytes(self.config, seq.num_computed), seq.cache.allocated_bytes(),
                             seq.logits if seq.params.return_logits else None, seq.error)


@model_op("sample")
def sample_tokens(ctx, rows: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                  positions: list[int]) -> list[int]:
    """One token per row of FP32 logits [B, V] (finite: the engine fails a request whose logits are
    not before it samples), each row on its own: ``sampler.sample`` with its request's settings,
    seed and position, so a token never depends on the rest of the batch."""
    return [sample(row, p, seed, pos) for row, p, seed, pos in zip(rows, params, seeds, positions)]


def _non_finite(row: torch.Tensor) -> str:
    """'3 NaN and 1 infinite values of 1024' for a logits row that is not all finite."""
    finite = torch.isfinite(row)
    nan = int(torch.isnan(row).sum())
    return f"{nan} NaN and {row.numel() - int(finite.sum()) - nan} infinite values of {row.numel()}"


class LLM(LLMEngine):
    """`LLM(path_or_preset).generate(prompt_token_ids, sampling_params)`."""

    def generate(self, prompt_token_ids, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, raise_on_error: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion. A request whose logits are not finite is failed, not sampled
        (finish_reason "error", `error` says where); the others run on. Then, with `raise_on_error`,
        GenerationError names the first failure and carries all outputs."""
        prompts = [prompt_token_ids] if prompt_token_ids and isinstance(prompt_token_ids[0], int) else prompt_token_ids
        params = sampling_params
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        before = self.model.ctx.tally.snapshot()
        total = sum(sp.max_tokens for sp in params)
        bar = tqdm(total=total, unit="tok", disable=not use_tqdm, leave=False)
        start, steps, done = time.perf_counter(), 0, 0
        while self.scheduler.has_work:
            self.step()
            steps += 1
            now = sum(len(s.output) for s in seqs)
            bar.update(now - done)
            done = now
        bar.close()
        outputs = [self.output(s) for s in seqs]
        self.last_stats = GenerateStats(sum(len(p) for p in prompts), done, steps, time.perf_counter() - start,
                                        sum(o.cache_bytes.total for o in outputs),
                                        self.model.ctx.tally.since(before))
        failed = [o for o in outputs if o.finish_reason == "error"]
        if failed and raise_on_error:
            more = f" ({len(failed) - 1} more requests failed)" if len(failed) > 1 else ""
            raise GenerationError(failed[0].error + more, outputs)
        return outputs
