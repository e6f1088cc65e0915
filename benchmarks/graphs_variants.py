"""The CUDA graphs of a step's sections (`runtime/graphs.py`) against eager launches, in variants
that tell a fault's kind apart: a generation on the generated kernels, each variant in a process
of its own, and per request whether it completed and where its logits first stopped being finite.

    python3 benchmarks/graphs_variants.py                      # every variant, one after another
    python3 benchmarks/graphs_variants.py --variant clone:attention:3
    python3 benchmarks/graphs_variants.py --variant eager --memcheck   # stray reads, named

Variants (``--variant``; all by default, each in a subprocess):

* ``eager``: every kernel launched from Python (the tokens the others are compared with);
* ``graphs``: the sections replayed from CUDA graphs, as ``duotile generate --graphs`` runs them;
* ``poison``: eager, every floating CUDA tensor made by ``torch.empty`` filled with NaN and every
  integer one with -1 (a kernel reading an output it did not write shows);
* ``ownpool``: graphs, each in a memory pool of its own rather than one shared pool;
* ``clone``: graphs, each replay's outputs copied before the model reads them;
* ``clone:SECTION[:I,J]``: graphs, only outputs I, J of sections named SECTION (``attention``,
  ``ffn``) copied (every output where no index is given);
* ``alias``: graphs, each replay's outputs handed out as new tensor objects on the same memory;
* ``sync``: graphs, the host waiting for the GPU after each replay (nothing allocated, nothing
  copied: where ``clone`` helps and ``sync`` does not, the fault is where tensors lie, not when
  the host queues work; ``check`` and ``finite`` wait too);
* ``check``: graphs with ``DUOTILE_GRAPHS_CHECK=1`` (each replay compared bit for bit with the
  section run eagerly);
* ``finite``: graphs, each replay's inputs and outputs checked for non-finite values (a host read
  a replay; nothing allocated beside a few flags): the first replay whose outputs are not finite
  is named with its section, shapes and whether its inputs were, which says whether the NaN
  starts inside a graph or in the eager part before it.

``--memcheck`` runs the variant under ``compute-sanitizer --tool memcheck`` with PyTorch's caching
allocator off (``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: each tensor its own allocation, so a kernel
reading past a tensor's end reads past an allocation, which memcheck reports with the kernel's
name); the sanitizer's report follows the variant's lines.

The workload, by default, is the one whose graphs gave NaN logits on an H100 (2026-12-07; the
table in docs/runtime.md, "CUDA graphs of a step's sections"): tiny V4.1, the prompt 1 2 3 4 5,
four requests of 8, 16, 24 and 32 greedy tokens (the batch shrinks from four to one). Needs a
CUDA GPU. The script builds the workload's 103 kernels first, in parallel (`duotile build
--signatures benchmarks/signatures/v41-tiny_requests4.json --target sm90 --jobs N`, about 170 s on
a cold H100; builds in the cache are hits), unless ``--no-prebuild``: the cache is keyed by the
compiler's sources, and a variant left to build them one at a time runs past its time limit.
That list was written by `duotile generate --prompt-ids 1 2 3 4 5 --requests 4 --max-tokens 32
--kernels generated --save-builds FILE` on the CPU (94 s).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("eager", "graphs", "sync", "finite", "clone", "poison", "ownpool", "check")


def _poison_empty(torch) -> None:
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_cuda and t.is_floating_point():
            t.fill_(float("nan"))
        elif t.is_cuda and t.dtype != torch.bool:
            t.fill_(-1)
        return t

    torch.empty = empty


def _after_replay(graphs, post) -> None:
    """Each replay's outputs handed to ``post(sections, hit, inputs, outputs)``, and its result handed
    out in their place (``hit``: the graph replayed; ``inputs``: the caller's, which a replay only reads)."""
    real = graphs.Sections._replay

    def replay(self, tally, hit, inputs):
        return post(self, hit, inputs, real(self, tally, hit, inputs))

    graphs.Sections._replay = replay


def _key_of(sections, hit) -> tuple:
    """The (section name, input shapes and dtypes) a graph was captured for."""
    return next(key for key, graph in sections._graphs.items() if graph is hit)


def _patch_replay(graphs, torch, variant: str) -> None:
    """Post-process each replay's outputs as ``variant`` says (clone, clone:SECTION[:I,J], alias)."""
    part, which = (variant.split(":") + ["", ""])[1:3]
    keep = {int(i) for i in which.split(",")} if which else None

    def fresh(t):
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                    t.shape, t.stride())

    def post(sections, hit, inputs, out):
        if variant == "alias":
            return tuple(fresh(t) for t in out)
        name = _key_of(sections, hit)[0][0]
        return tuple(t.clone() if (not part or name == part) and (keep is None or i in keep) else t
                     for i, t in enumerate(out))

    _after_replay(graphs, post)


def _patch_sync(graphs, wait) -> None:
    """``wait()`` after each replay (``sync``: ``torch.cuda.synchronize``)."""
    _after_replay(graphs, lambda sections, hit, inputs, out: wait() or out)


def _patch_finite(graphs, torch) -> None:
    """Name the first replay whose outputs are not all finite (``finite``)."""
    seen = []

    def finite(ts) -> list[bool]:
        return [not t.is_floating_point() or bool(torch.isfinite(t).all()) for t in ts]

    def post(sections, hit, inputs, out):
        bad = [i for i, ok in enumerate(finite(out)) if not ok]
        if bad and not seen:
            key = _key_of(sections, hit)
            seen.append(key)
            print(f"  first non-finite replay: section {key[0]}, input shapes {[sh for sh, _ in key[1:]]}, replay "
                  f"{sections.replays}, outputs {bad} not finite; inputs all finite: {all(finite(inputs))}",
                  flush=True)
        return out

    _after_replay(graphs, post)


def run_variant(args) -> None:
    import torch

    from duotile.runtime import graphs
    from duotile.runtime.cli import _requests
    from duotile.runtime.engine import LLM
    from duotile.runtime.sampler import SamplingParams

    variant = args.variant
    if variant == "poison":
        _poison_empty(torch)
    elif variant == "ownpool":
        capture = graphs._cuda_capture
        graphs._cuda_capture = lambda fn, inputs, pool: capture(fn, inputs, None)
    elif variant.startswith("clone") or variant == "alias":
        _patch_replay(graphs, torch, variant)
    elif variant == "sync":
        _patch_sync(graphs, torch.cuda.synchronize)
    elif variant == "finite":
        _patch_finite(graphs, torch)
    if variant == "check":
        os.environ["DUOTILE_GRAPHS_CHECK"] = "1"
    prompts, params = _requests(args.prompt_ids, SamplingParams(max_tokens=args.max_tokens, return_logits=True),
                                args.requests)
    llm = LLM(args.model, device="cuda", kernels="generated", graphs=variant not in ("eager", "poison"))
    start = time.perf_counter()
    outs = llm.generate(prompts, params, raise_on_error=False)
    print(f"variant {variant}: {time.perf_counter() - start:.1f} s")
    for i, out in enumerate(outs):
        bad = [j for j, row in enumerate(out.logits or []) if not torch.isfinite(row).all()]
        where = f"; first non-finite logits at generated token {bad[0]}" if bad else ""
        print(f"  request {i}: {out.finish_reason}, tokens {' '.join(map(str, out.token_ids))}{where}")
    if llm.model.ctx.sections is not None:
        print("  " + llm.model.ctx.sections.report())


def _memcheck(args, argv: list[str]) -> int:
    """The variant again in a subprocess under memcheck, the caching allocator off (module docstring)."""
    import shutil

    if not args.variant:
        print("--memcheck runs one variant: give --variant", file=sys.stderr)
        return 2
    found = sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))
    tool = shutil.which("compute-sanitizer") or (str(found[0]) if found else None)
    if tool is None:
        print("--memcheck: no compute-sanitizer on PATH or under /usr/local/cuda*/bin", file=sys.stderr)
        return 2
    inner = [a for a in argv if a not in ("--memcheck", "--no-prebuild")] + ["--no-prebuild"]  # main built them
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    cmd = [tool, "--tool", "memcheck", "--print-limit", "30", sys.executable, __file__, *inner]
    return subprocess.run(cmd, env=env).returncode


SIGNATURES = Path(__file__).resolve().parent / "signatures" / "v41-tiny_requests4.json"


def prebuild_command(jobs: int) -> list[str]:
    """The build of the default workload's kernels, ``jobs`` at a time (module docstring)."""
    return [sys.executable, "-m", "duotile", "build", "--signatures", str(SIGNATURES), "--target", "sm90",
            "--jobs", str(jobs)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", help=f"one variant in this process (default: each of {', '.join(VARIANTS)} in "
                                     "a subprocess)")
    p.add_argument("--model", default="v41-tiny")
    p.add_argument("--prompt-ids", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=int, default=120, help="seconds a variant may run")
    p.add_argument("--memcheck", action="store_true", help="run --variant under compute-sanitizer's memcheck")
    p.add_argument("--no-prebuild", action="store_true", help="do not build the default workload's kernels first")
    args = p.parse_args(argv)
    default = (args.model, args.prompt_ids, args.requests, args.max_tokens) == ("v41-tiny", [1, 2, 3, 4, 5], 4, 32)
    if not args.no_prebuild and default:
        jobs = max(1, (os.cpu_count() or 2) - 1)
        print(f"building the workload's kernels ({jobs} at a time)", flush=True)
        built = subprocess.run(prebuild_command(jobs), capture_output=True, text=True)
        if built.returncode:
            print(f"the build failed (exit {built.returncode}):\n{built.stdout[-800:]}{built.stderr[-800:]}",
                  file=sys.stderr)
            return built.returncode
        print((built.stdout.strip().splitlines() or [""])[-1], flush=True)  # how many were in the cache
    if args.memcheck:
        return _memcheck(args, argv if argv is not None else sys.argv[1:])
    if args.variant:
        run_variant(args)
        return 0
    rest = ["--no-prebuild",  # built above, where it is the default workload
            "--model", args.model, "--prompt-ids", *map(str, args.prompt_ids), "--requests", str(args.requests),
            "--max-tokens", str(args.max_tokens)]
    for variant in VARIANTS:
        try:
            done = subprocess.run([sys.executable, __file__, "--variant", variant, *rest], capture_output=True,
                                  text=True, timeout=args.timeout)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith(("variant", "  "))]
            print("\n".join(lines) or f"variant {variant}: exit {done.returncode}\n{done.stderr[-600:]}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"variant {variant}: over {args.timeout} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
