"""The host glue of a decode step: the torch calls a tiny model's decode forward makes outside its
generated kernels (``--kernels generated``, the interpreter on a CPU; each would be a launch, a copy
or host work on a GPU), by op and by the runtime line that makes them. Runs on any machine.

    python3 benchmarks/step_glue.py [--model v41-tiny] [--top 25] [--out step_glue]

A kernel's own body (the interpreter's torch calls) is not counted; the calls that prepare its
arguments and read its results are. ``--out NAME`` writes ``results/NAME.md``.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duotile.runtime.engine import LLM  # noqa: E402
from duotile.runtime.sampler import SamplingParams  # noqa: E402

PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7], list(range(20)))


class Counter(TorchDispatchMode):
    """Counts the aten calls made while ``on`` and outside a kernel (``inside`` > 0)."""

    def __init__(self):
        super().__init__()
        self.on, self.inside = False, 0
        self.ops: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on and not self.inside:
            name = func.__name__.split(".")[0]
            self.ops[name] += 1
            frames = [f for f in traceback.extract_stack()[:-1] if "/duotile/" in f.filename]
            if frames:
                f = frames[-1]
                self.sites[f"`{f.filename.split('/duotile/')[-1]}:{f.lineno}` {name}"] += 1
        return func(*args, **(kwargs or {}))


def count(model: str) -> tuple[Counter, int]:
    """One generation of three requests; the counts over its decode forwards, and how many."""
    llm = LLM(model, kernels="generated")
    counter, ops = Counter(), llm.model.ctx.ops
    compiled = ops._compiled

    def wrapped(*args, **kw):  # every kernel the ops make runs with counting paused
        kernel = compiled(*args, **kw)

        class Paused:
            _cache = kernel._cache

            def __call__(self, *a, **k):
                counter.inside += 1
                try:
                    return kernel(*a, **k)
                finally:
                    counter.inside -= 1
        return Paused()

    ops._compiled, forward, decodes = wrapped, llm.model.forward, [0]
    ops._by_call.clear()

    def counted(chunks, **kw):
        counter.on = all(c.tokens.numel() == 1 for c in chunks)
        decodes[0] += counter.on
        try:
            return forward(chunks, **kw)
        finally:
            counter.on = False

    llm.model.forward = counted
    with counter:
        llm.generate([list(p) for p in PROMPTS], [SamplingParams(max_tokens=4, ignore_eos=True)] * len(PROMPTS))
    return counter, decodes[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v41-tiny", help="a tiny preset (default: v41-tiny)")
    ap.add_argument("--top", type=int, default=25, help="sites listed (default: 25)")
    ap.add_argument("--out", help="results file stem under benchmarks/results")
    args = ap.parse_args(argv)
    counter, steps = count(args.model)
    per = sum(counter.ops.values()) / max(steps, 1)
    lines = [f"# Host glue of a decode step ({time.strftime('%Y-%m-%d')})", "",
             f"`python3 benchmarks/step_glue.py --model {args.model}`", "",
             f"{args.model}, `--kernels generated` on the interpreter, 3 requests decoding together: "
             f"{per:.0f} torch calls a decode step outside the kernels ({steps} decode steps counted).", "",
             "| op | calls a step |", "|---|---|"]
    lines += [f"| `{op}` | {n / steps:.1f} |" for op, n in counter.ops.most_common(args.top)]
    lines += ["", "| site and op | calls a step |", "|---|---|"]
    lines += [f"| {site} | {n / steps:.1f} |" for site, n in counter.sites.most_common(args.top)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        (Path(__file__).parent / "results" / f"{args.out}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
