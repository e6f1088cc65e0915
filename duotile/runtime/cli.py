"""`duotile generate`: run the reference runtime on prompt token ids and report speed and cache bytes."""

from __future__ import annotations

import argparse
import sys

import torch

from .config import ConfigError
from .presets import DEFAULT_PRESET, TINY_PRESETS
from .sampler import SamplingParams
from .weights import CheckpointError

PROGRESS_MIN_TOKENS = 32


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate tokens with the PyTorch reference runtime",
                              description="Generate from prompt token ids. Without --model the embedded tiny "
                              f"V4.1 model ({DEFAULT_PRESET}) is written to the cache on first use and loaded.")
    p.add_argument("--model", default=DEFAULT_PRESET,
                   help=f"checkpoint directory or tiny preset {list(TINY_PRESETS)} (default {DEFAULT_PRESET})")
    p.add_argument("--prompt-ids", type=int, nargs="+", required=True, metavar="ID")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (the draw depends on seed and position)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--batch-invariant", action="store_true", help="row-wise, fixed-order kernels (bitwise "
                   "independent of batch and chunking)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--kernels", choices=("reference", "generated"), default="reference",
                   help="generated: run duotile's kernels where a spec covers the op (RMSNorm today); sm90 "
                        "build on an H200, the interpreter elsewhere")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (tiny models are fastest with 1)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .engine import LLM  # imported lazily: `duotile --help` stays fast

    torch.set_num_threads(max(1, args.threads))
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, dtype=getattr(torch, args.dtype), batch_invariant=args.batch_invariant,
                  device=args.device, kernels=args.kernels)
        show = not args.no_progress and args.max_tokens >= PROGRESS_MIN_TOKENS
        out = llm.generate(args.prompt_ids, params, use_tqdm=show)[0]
    except (ConfigError, CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stats, cb = llm.last_stats, out.cache_bytes
    print("tokens:", " ".join(map(str, out.token_ids)))
    print(f"speed: {stats.generated_tokens} tokens in {stats.seconds:.2f} s = {stats.tokens_per_second:.1f} tokens/s")
    print(f"cache bytes: {cb.total} (window {cb.window}, compressed {cb.compressed}, index keys {cb.index_keys}, "
          f"compressor state {cb.compressor_state}, engram history {cb.engram_history}); "
          f"reference tensors {out.allocated_cache_bytes}")
    return 0
