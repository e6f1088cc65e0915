"""Two checkouts of duotile, the same kernels, one GPU: how a change to the generators or passes
moves the time of what a user gets. Usage on the H200:

    git worktree add /tmp/base <commit>        # or: git archive <commit> duotile | tar -x -C /tmp/base
    python3 benchmarks/ab_checkouts.py --base /tmp/base gemm_blockscaled:v4/wq_b/prefill4096 \\
        gemm:v41/wq_b/prefill4096 [--config NAME=VALUE ...] [--rounds 2] [--jobs 15]

Each ``SPEC:SHAPE`` (a spec and one of its model shapes) is built by both checkouts, in parallel
processes first (``--jobs``), with the config a user gets (no config given) unless ``--config``
sets one for every shape. Then, ``--rounds`` times, each checkout in turn times every shape in a
process of its own (15 calls, each after a 256 MiB write that flushes L2; the median) and checks
its output against the spec's reference. One JSON line a measurement, then a table of the medians
over rounds and the ratio base / this checkout (above 1: this checkout is faster). A run stopped
by SIGTERM (``timeout``) prints the table of what it had measured; each build's completion is a
JSON line too (``"built"``), so a log cut during the builds says how far they got: on a cold
H100 host, 52 builds (26 shapes, both checkouts, 15 processes) took more than 230 s (2026-12-07).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def measure(root: str, shapes: list[str], config: dict, build_only: bool) -> None:
    """In this process: import duotile from ``root``, then build (and time) each shape."""
    sys.path.insert(0, root)
    import torch

    from duotile import codegen
    from duotile.kernels_spec.compare import mismatch
    from duotile.kernels_spec.registry import load_all

    specs = load_all()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for arg in shapes:
        name, _, shape = arg.partition(":")
        spec = specs[name]
        case = spec.model_cases()[shape]
        try:
            kernel = codegen.compile(spec.kernel, "sm90", config=config or None, constants=spec.constants_of(case))
            inputs = spec.make_inputs(case, torch.device("cuda"), 0)
            kernel(**inputs)
            torch.cuda.synchronize()
            if build_only:
                print(json.dumps({"root": root, "shape": arg, "built": True}), flush=True)
                continue
            off = mismatch(spec, case, inputs, spec.run_reference(inputs, case))
            times = []
            for _ in range(15):
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                kernel(**inputs)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            row = {"us": round(statistics.median(times), 1), "check": "ok" if off is None else f"FAIL ({off})"}
        except Exception as err:  # a shape that fails to build or run is a row, not the end of the run
            row = {"error": str(err).splitlines()[0][:200]}
        print(json.dumps({"root": root, "shape": arg, **row}), flush=True)


class Stopped(Exception):
    """SIGTERM (a phase's ``timeout``): the run ends with the table of what it measured."""


def _stop(signum, frame):
    raise Stopped


def run(base: str, shapes: list[str], config: dict, rounds: int, jobs: int, rows: list[dict]) -> None:
    """Build every shape of both checkouts, then time them ``rounds`` times, appending each
    measurement to ``rows`` as it comes (a run cut short keeps what it measured). Each build and
    each measurement is a JSON line on stdout as it finishes."""
    roots = [base, str(HERE)]
    live: set[subprocess.Popen] = set()

    def child(root, args, build_only):
        cmd = [sys.executable, __file__, "--child", root, *args]
        env = {**os.environ, "AB_CONFIG": json.dumps(config), **({"AB_BUILD_ONLY": "1"} if build_only else {})}
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) as proc:
            live.add(proc)
            out = proc.communicate()[0]
            live.discard(proc)
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

    pool = ThreadPoolExecutor(jobs)
    try:
        # the builds, every shape of both checkouts at once
        for built in pool.map(lambda job: child(*job, True), [(r, [s]) for r in roots for s in shapes]):
            for row in built:
                print(json.dumps(row), flush=True)
        for _ in range(rounds):
            for root in roots:
                for row in child(root, shapes, False):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:  # stopped: no build or timing outlives the run
        for proc in list(live):
            proc.kill()
        pool.shutdown(wait=False, cancel_futures=True)


def table(rows: list[dict], base: str, shapes: list[str]) -> str:
    def median(root, shape):
        us = [r["us"] for r in rows if r["root"] == root and r["shape"] == shape and "us" in r]
        return statistics.median(us) if us else None

    def checks(root, shape):
        return ", ".join(sorted({r.get("check", "error") for r in rows if r["root"] == root and r["shape"] == shape}))

    lines = ["| shape | base_us | this_us | base / this | check (base; this) |", "|---|---|---|---|---|"]
    for s in shapes:
        b, t = median(base, s), median(str(HERE), s)
        ratio = f"{b / t:.2f}" if b and t else "-"
        lines.append(f"| {s} | {b or '-'} | {t or '-'} | {ratio} | {checks(base, s)}; {checks(str(HERE), s)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="+", help="SPEC:SHAPE, e.g. gemm:v41/wq_b/prefill4096")
    p.add_argument("--base", help="the other checkout (a directory holding duotile/)")
    p.add_argument("--config", action="append", default=[], help="NAME=VALUE for every shape (repeatable)")
    p.add_argument("--rounds", type=int, default=2, help="timing passes, each checkout in turn")
    p.add_argument("--jobs", type=int, default=15, help="processes that build at once")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:  # duotile not imported yet: the child imports the checkout it measures
        measure(args.child, args.shapes, json.loads(os.environ["AB_CONFIG"]), bool(os.environ.get("AB_BUILD_ONLY")))
        return 0
    sys.path.insert(0, str(HERE))
    from duotile.codegen.cli import _assignment

    config = dict(_assignment(text) for text in args.config)
    if not args.base or not Path(args.base, "duotile").is_dir():
        p.error(f"--base {args.base!r}: give a directory that holds a checkout's duotile/")
    rows: list[dict] = []
    signal.signal(signal.SIGTERM, _stop)
    try:
        run(str(Path(args.base).resolve()), args.shapes, config, args.rounds, args.jobs, rows)
    except Stopped:
        print(f"stopped (SIGTERM) after {len(rows)} measurements: the table holds those", flush=True)
    print(table(rows, str(Path(args.base).resolve()), args.shapes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
