"""The host time of a call into a compiled kernel, its launches left out: what duotile's own
Python adds per call (the call key, the workspaces, the phase loop). Runs on any machine (the
interpreter target's build, each launch replaced by a no-op).

    python3 benchmarks/host_path.py [--calls 2000] [--trials 15]   # a one- and a two-phase gemm
    python3 benchmarks/host_path.py --specs all [--shapes '*decode1']  # every spec at its model shapes

``--specs`` calls each spec at each model shape (matching ``--shapes``) on tensors of the meta
device (no memory, no launch) and lists the host time a call, slowest first: a decode step calls
dozens of kernels, and a call whose Python outlasts its kernel leaves the GPU idle.
"""

from __future__ import annotations

import argparse
import fnmatch
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duotile import codegen  # noqa: E402
from duotile.codegen.compile import load_phases  # noqa: E402
from duotile.codegen.target import get_target  # noqa: E402
from duotile.kernels_spec.registry import get, load_all  # noqa: E402

CONFIGS = {"one phase": {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 1},
           "two phases (split K)": {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 2}}


def _best_us(kernel, inputs: dict, calls: int, trials: int) -> float:
    """The best of ``trials`` runs of ``calls`` calls, microseconds a call."""
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(calls):
            kernel(**inputs)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def host_us(config: dict, calls: int, trials: int) -> float:
    spec = get("gemm")
    inputs = spec.make_inputs({"M": 1, "N": 64, "K": 64}, torch.device("cpu"), 0)
    kernel = codegen.compile(spec.kernel, "interpret", config=config)
    kernel(**inputs)
    for call in kernel._calls.values():
        call.fns = [lambda args: None for _ in call.fns]
    return _best_us(kernel, inputs, calls, trials)


def spec_us(spec, case, calls: int, trials: int) -> float:
    """One call's host time of ``spec`` at ``case`` (meta tensors, launches replaced by no-ops)."""
    inputs = spec.make_inputs(case, torch.device("meta"), 0)
    kernel = codegen.compile(spec.kernel, "interpret", constants=spec.constants_of(case))
    padded = kernel._padded(inputs)
    phases, artifacts, _fn, key = kernel._prepare(padded)
    call = load_phases(get_target("interpret"), phases, artifacts)
    call.fns = [lambda args: None for _ in call.fns]
    kernel._cache[key] = (phases, artifacts, call)
    kernel(**inputs)  # binds the call's key
    return _best_us(kernel, inputs, calls, trials)


def sweep(names: list[str], patterns: list[str], calls: int, trials: int) -> list[tuple[float, str, str]]:
    """(host us, spec, shape) for each spec's model shapes that match ``patterns``, slowest first."""
    specs = load_all()
    rows = []
    for name in sorted(specs) if names == ["all"] else names:
        for shape, case in specs[name].model_cases().items():
            if patterns and not any(fnmatch.fnmatch(shape, p) for p in patterns):
                continue
            rows.append((spec_us(specs[name], case, calls, trials), name, shape))
    return sorted(rows, reverse=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls a trial")
    p.add_argument("--trials", type=int, default=15, help="trials; the best is reported")
    p.add_argument("--specs", default=None, help="comma-separated specs, or all: each at its model shapes")
    p.add_argument("--shapes", action="append", default=[], metavar="PATTERN",
                   help="with --specs: the model shapes whose name matches (fnmatch; repeatable)")
    p.add_argument("--out", default=None, help="with --specs: also write the table here (markdown)")
    args = p.parse_args(argv)
    if args.specs:
        rows = sweep(args.specs.split(","), args.shapes, max(1, args.calls // 10), max(1, args.trials // 5))
        lines = [f"Host time a call, launches left out ({time.strftime('%Y-%m-%d')}, this CPU: "
                 f"{platform.processor() or platform.machine()}; `host_path.py --specs {args.specs}"
                 + "".join(f" --shapes '{s}'" for s in args.shapes) + "`)", "",
                 "| spec | model shape | host us a call |", "|---|---|---|"]
        lines += [f"| {name} | {shape} | {us:.1f} |" for us, name, shape in rows]
        print("\n".join(lines))
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
        return 0
    for name, config in CONFIGS.items():
        print(f"gemm {name}: {host_us(config, args.calls, args.trials):.2f} us a call of host time, launches left out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
