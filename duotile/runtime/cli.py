"""`duotile generate` and `duotile check-model`: run the reference runtime; check a checkpoint's values.

Every failure a user can cause (a bad config value, a corrupt checkpoint, a missing device, a request
whose logits are not finite) ends in one line on stderr, `duotile <command>: <what is wrong>`, and
exit status 2; `--debug` (or DUOTILE_DEBUG=1) lets the exception through with its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .config import ConfigError
from .device import DeviceError, resolve_device
from .model_ops import format_report
from .presets import DEFAULT_PRESET, TINY_PRESETS, preset_notes
from .sampler import SamplingParams
from .weights import CheckpointError

PROGRESS_MIN_TOKENS = 32
RELEASED = ("v4-flash", "v41-flash")  # --layers N runs one of these on N layers
USER_ERRORS = (ConfigError, CheckpointError, DeviceError, ValueError)


def fail(args: argparse.Namespace, err: BaseException) -> int:
    """One line on stderr and exit 2; with --debug (or DUOTILE_DEBUG=1) the exception propagates."""
    if getattr(args, "debug", False) or os.environ.get("DUOTILE_DEBUG", "") not in ("", "0"):
        raise err
    print(f"duotile {getattr(args, 'command', 'generate')}: {err}", file=sys.stderr)
    return 2


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_generate(subparsers)
    from .check import register as register_check

    register_check(subparsers)


def _register_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate tokens with the PyTorch reference runtime",
                              description="Generate from prompt token ids. Without --model the embedded tiny "
                              f"V4.1 model ({DEFAULT_PRESET}) is written to the cache on first use and loaded.")
    p.add_argument("--model", default=DEFAULT_PRESET, metavar="PATH|PRESET",
                   help=f"checkpoint directory or tiny preset {list(TINY_PRESETS)}; with --layers, a released "
                        "model (v4-flash, v41-flash) (default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="the released --model on N of its layers, real widths and expert counts, every kind of "
                        "layer N allows (8 cover V4.1's, 4 V4's); its random checkpoint is written to the cache "
                        "on first use (tens of GB) (default: all layers, which needs the checkpoint directory)")
    p.add_argument("--prompt-ids", type=int, nargs="+", required=True, metavar="ID",
                   help="the prompt's token ids (required; no default)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default: %(default)s)")
    p.add_argument("--requests", type=int, default=1, metavar="N",
                   help="run N copies of the prompt together, request i stopping after (i+1)/N of --max-tokens, "
                        "so the batch shrinks from N to 1 as they finish; the longest request's tokens are printed "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed; the draw depends on seed and position. Has no effect under greedy "
                        "decoding (--temperature 0). (default: none - the engine's own seed)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy decoding (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 keeps all "
                   "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep, in (0, 1] "
                   "(default: %(default)s)")
    p.add_argument("--batch-invariant", action="store_true", help="row-wise, fixed-order kernels (bitwise "
                   "independent of batch and chunking) (default: off)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="activation dtype (default: %(default)s)")
    p.add_argument("--kernels", choices=("reference", "generated"), default="reference",
                   help="generated: run duotile's kernels for the model ops a spec covers (the ops report "
                        "printed after the tokens says which ran where); sm90 builds on an H200, the "
                        "interpreter elsewhere (default: %(default)s)")
    p.add_argument("--fp8-wo-a", action="store_true",
                   help="run the grouped output projection wo_a as engines do, its input quantised to FP8 "
                        "and its FP8 codes read, not in BF16 on its dequantised value as the released "
                        "reference does (default: off, the reference's numerics)")
    p.add_argument("--graphs", action="store_true",
                   help="with --kernels generated on a GPU: replay each layer's attention projections and FFN "
                        "half of a step of up to 64 tokens from CUDA graphs (experimental: right on the one GPU "
                        "workload it has run; default: every kernel launched from Python)")
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N], npu[:N] (needs torch_npu) or mps "
                   "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads; tiny models are fastest with 1 (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true",
                   help=f"hide the progress bar shown from {PROGRESS_MIN_TOKENS} tokens on (default: shown)")
    p.add_argument("--save-builds", default=None, metavar="FILE",
                   help="with --kernels generated: write the build signatures the generation met to FILE "
                        "(JSON), for `duotile build --signatures FILE` to build them in parallel for a GPU "
                        "target (default: not written)")
    p.add_argument("--build-ahead", type=int, default=0, metavar="JOBS",
                   help="with --kernels generated: before generating, find the builds a short run of the "
                        "same requests (two tokens each) meets and build them in JOBS processes, in rounds "
                        "(a GPU's first generation otherwise builds each kernel at its first call, one at a "
                        "time); 0: off (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .engine import LLM, GenerationError  # imported lazily: `duotile --help` stays fast

    torch.set_num_threads(max(1, args.threads))
    if args.seed is not None and args.temperature == 0:
        print("note: --seed has no effect with --temperature 0 (greedy decoding picks the most likely token)",
              file=sys.stderr)
    if args.graphs:
        print("note: --graphs is experimental: it has run one GPU workload, where it gave the eager tokens, and "
              "its bitwise test has not yet run on a GPU (docs/runtime.md, \"CUDA graphs of a step's sections\"); "
              "a request whose logits are not finite is failed, not sampled", file=sys.stderr)
    for flag, value in (("--save-builds", args.save_builds), ("--build-ahead", args.build_ahead),
                        ("--graphs", args.graphs)):
        if value and args.kernels != "generated":
            return fail(args, ValueError(f"{flag} needs --kernels generated (the reference ops build nothing)"))
    if args.layers is not None:
        if args.model not in RELEASED:
            return fail(args, ValueError(f"--layers needs a released model as --model ({', '.join(RELEASED)}), "
                                         f"got {args.model!r}"))
        args.model = f"{args.model}-L{args.layers}"
        try:
            for note in preset_notes(args.model):
                print(f"note: {note}", file=sys.stderr)
        except USER_ERRORS as err:
            return fail(args, err)
    try:
        device = resolve_device(args.device)
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                max_tokens=args.max_tokens, seed=args.seed)
        llm = LLM(args.model, dtype=getattr(torch, args.dtype), batch_invariant=args.batch_invariant,
                  device=device, kernels=args.kernels, fp8_wo_a=args.fp8_wo_a, graphs=args.graphs)
        show = not args.no_progress and args.max_tokens >= PROGRESS_MIN_TOKENS
        if args.build_ahead:
            _build_ahead(llm, args, params)
        out = llm.generate(*_requests(args.prompt_ids, params, args.requests), use_tqdm=show)[-1]
    except GenerationError as err:
        partial = err.outputs[0].token_ids
        if partial:
            print("tokens (before the failure):", " ".join(map(str, partial)))
        return fail(args, err)
    except USER_ERRORS as err:
        return fail(args, err)
    stats, cb = llm.last_stats, out.cache_bytes
    print("tokens:", " ".join(map(str, out.token_ids)))
    for line in format_report(stats.ops, getattr(llm.model.ctx.ops, "builds", dict)()):
        print("op", line)
    if llm.model.ctx.sections is not None:
        print(llm.model.ctx.sections.report())
    if args.save_builds:
        from ..codegen import prebuild

        sigs = llm.model.ctx.ops.signatures()
        prebuild.save(sigs, args.save_builds)
        print(f"builds: {len(sigs)} signatures written to {args.save_builds}")
    print(f"speed: {stats.generated_tokens} tokens in {stats.seconds:.2f} s = {stats.tokens_per_second:.1f} tokens/s")
    print(f"cache bytes: {cb.total} (window {cb.window}, compressed {cb.compressed}, index keys {cb.index_keys}, "
          f"compressor state {cb.compressor_state}, engram history {cb.engram_history}); "
          f"reference tensors {out.allocated_cache_bytes}")
    model = llm.model
    print(f"weight bytes: {model.weight_bytes} on {model.device} ({model.weights_kept}: "
          + ("the FP8 / FP4 codes and their scales as released)" if model.weights_kept == "packed"
             else "FP8 / FP4 weights expanded to FP32)"))
    return 0


def _build_ahead(llm, args: argparse.Namespace, params) -> None:
    """``--build-ahead``: the builds of a two-token run of the same requests, made in rounds
    (`runtime/generated/ahead.py`); what a longer generation meets beyond them builds at its call."""
    import dataclasses

    from .generated.ahead import build_ahead

    short = dataclasses.replace(params, max_tokens=min(2, params.max_tokens))
    prompts, plist = _requests(args.prompt_ids, short, args.requests)
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    report = build_ahead(llm.model.ctx.ops, lambda: llm.generate(prompts, plist, use_tqdm=False), args.build_ahead,
                         log=log)
    log(f"build ahead: {report.built} builds in {len(report.rounds)} rounds, "
        f"{sum(r.run_s + r.build_s for r in report.rounds):.0f} s")


def _requests(prompt: list[int], params, n: int):
    """(prompts, params) for ``--requests N``: the last request runs the whole --max-tokens."""
    import dataclasses

    if n < 1:
        raise ValueError(f"--requests {n}: at least one request")
    cut = [max(1, params.max_tokens * (i + 1) // n) for i in range(n)]
    return [list(prompt)] * n, [dataclasses.replace(params, max_tokens=m) for m in cut]
