"""The host time of a call into a compiled kernel, its launches left out: what duotile's own
Python adds per call (the call key, the workspaces, the phase loop). Runs on any machine (the
interpreter target's build, each launch replaced by a no-op).

    python3 benchmarks/host_path.py [--calls 2000] [--trials 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duotile import codegen  # noqa: E402
from duotile.kernels_spec.registry import get  # noqa: E402

CONFIGS = {"one phase": {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 1},
           "two phases (split K)": {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 2}}


def host_us(config: dict, calls: int, trials: int) -> float:
    spec = get("gemm")
    inputs = spec.make_inputs({"M": 1, "N": 64, "K": 64}, torch.device("cpu"), 0)
    kernel = codegen.compile(spec.kernel, "interpret", config=config)
    kernel(**inputs)
    for call in kernel._calls.values():
        call.fns = [lambda args: None for _ in call.fns]
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(calls):
            kernel(**inputs)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls a trial")
    p.add_argument("--trials", type=int, default=15, help="trials; the best is reported")
    args = p.parse_args(argv)
    for name, config in CONFIGS.items():
        print(f"gemm {name}: {host_us(config, args.calls, args.trials):.2f} us a call of host time, launches left out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
