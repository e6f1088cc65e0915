"""Every spec at every model shape, as a user gets it: no config given (``codegen.compile`` chooses
one), on sm90, against the torch peer timed in the same run.

    python3 benchmarks/bench_model_shapes.py [--kernels gemm,gemm_splitk,flash_attention,rmsnorm,mqa_decode | all]
                                             [--model v41-flash|v4-flash] [--shapes PATTERN ...]
                                             [--rounds 3] [--jobs 12]

Peers: torch's own operation where one computes the same thing (F.linear, torch._scaled_mm,
SDPA, torch.topk, a copy of RMSNorm's bytes, torch._grouped_mm in bf16 for the MXFP4 grouped
GEMM), the runtime's FP32 composite for sparse attention, else the spec's PyTorch reference on the
same GPU inputs (the composite a runtime without the kernel would run).

Each row: the shape, where its config came from (tuned / table / model / default), whether the
output matched the reference, our and the peer's median time over interleaved rounds, the ratio
(peer / ours: above 1 is faster than the peer), TFLOP/s or TB/s and the fraction of the ceiling
measured here (torch's own bf16 / fp8 GEMM rate, the copy bandwidth). Each spec's builds run first, in
``--jobs`` processes, so the timing loop only loads them. Writes results/bench_model_shapes.{md,json}.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import MEASURED, copy_bandwidth, interleaved, spec_peer, write_results  # noqa: E402
from duotile import codegen  # noqa: E402
from duotile.kernels_spec.compare import mismatch  # noqa: E402
from duotile.kernels_spec.registry import load_all  # noqa: E402

KERNELS = ("gemm", "gemm_splitk", "flash_attention", "rmsnorm", "mqa_decode")
COPY_TBS: dict[str, float] = {}


def _bytes(inputs: dict) -> float:
    return float(sum(t.numel() * t.element_size() for t in inputs.values() if torch.is_tensor(t)))


def _moved(spec, case, inputs: dict) -> float:
    """The bytes a call reads and writes: the spec's count where it declares one (a cache of which
    a call writes one row a sequence is not traffic), else every tensor argument once."""
    return float(spec.bytes_moved(case)) if spec.bytes_moved is not None else _bytes(inputs)


GEMMS = ("gemm", "gemm_splitk", "gemm_blockscaled")


def _ceiling(name: str, inputs: dict) -> tuple[str, float]:
    """(unit, the measured ceiling in that unit) a row is a fraction of."""
    if name in GEMMS and inputs["a"].shape[-2] > 64:
        fp8 = inputs["a"].dtype == torch.float8_e4m3fn
        return "TFLOP/s", MEASURED["fp8_tflops" if fp8 else "bf16_tflops"]
    if name == "flash_attention":
        return "TFLOP/s", MEASURED["bf16_tflops"]
    key = "copy"
    if key not in COPY_TBS:
        COPY_TBS[key] = copy_bandwidth(1 << 30)
    return "TB/s", COPY_TBS[key]


def _check(spec, case, inputs) -> str:
    off = mismatch(spec, case, inputs, spec.run_reference(inputs, case))
    return "ok" if off is None else f"FAIL ({off})"


def _prebuild(job):
    """Build (and JIT-load) one shape in a worker process: the timing loop then hits the caches."""
    name, cname = job
    spec = load_all()[name]
    case = spec.model_cases()[cname]
    try:
        kernel = codegen.compile(spec.kernel, "sm90", constants=spec.constants_of(case))
        kernel(**spec.make_inputs(case, torch.device("cuda"), 0))
        torch.cuda.synchronize()
        return cname, ""
    except Exception as err:  # noqa: BLE001 - reported in the row
        return cname, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


HEADER = ["kernel", "shape", "config", "check", "peer", "ours_us", "peer_us", "ratio", "rate", "of_ceiling"]


def run(names, model, rounds, jobs, budget_s, save=None, patterns=None):
    specs = load_all()
    cases = [(n, c) for n in names for c, case in specs[n].model_cases(model).items()
             if not patterns or any(fnmatch.fnmatch(c, p) for p in patterns)]
    kernels, rows, errors, timing_s = {}, [], {}, 0.0
    for i, (name, cname) in enumerate(cases):
        if timing_s > budget_s:
            rows.append({"kernel": name, "shape": cname, "check": "not run (time budget)"})
            continue
        if name != (cases[i - 1][0] if i else None):  # one spec's shapes built together, then timed
            errors.update(_build_spec(name, [c for c in cases if c[0] == name], jobs))
        t0 = time.monotonic()  # the budget counts the timing loop, not the builds
        spec = specs[name]
        case = spec.model_cases()[cname]
        row = {"kernel": name, "shape": cname}
        if errors.get((name, cname)):
            rows.append({**row, "check": errors[(name, cname)]})
            continue
        key = (name, tuple(sorted(spec.constants_of(case).items())))
        kernel = kernels.setdefault(key, codegen.compile(spec.kernel, "sm90", constants=spec.constants_of(case)))
        inputs = spec.make_inputs(case, torch.device("cuda"), 0)
        kernel(**inputs)
        torch.cuda.synchronize()
        row["check"] = _check(spec, case, inputs)
        sig = spec.kernel.bind(inputs)
        config = kernel._configs.get(sig.key()) or {}
        from duotile.codegen.choose_config import explain_choice

        row["config"] = explain_choice(spec.kernel, "sm90", sig, spec.constants_of(case))[1]
        label, peer_fn = _peer(spec, case, inputs, config)
        t = _timed({"peer": peer_fn, "ours": _call(kernel, inputs)}, rounds)
        ours, theirs = statistics.median(t["ours"]), statistics.median(t["peer"])
        unit, ceiling = _ceiling(name, inputs)
        work = spec.flops(case) if unit == "TFLOP/s" else _moved(spec, case, inputs)
        rate = work / (ours * 1e-3) / 1e12
        row.update({"peer": label, "ours_us": f"{ours * 1e3:.1f}", "peer_us": f"{theirs * 1e3:.1f}",
                    "ratio": f"{theirs / ours:.3f}", "rate": f"{rate:.2f} {unit}",
                    "of_ceiling": f"{rate / ceiling:.0%}"})
        if unit == "TFLOP/s" and name in GEMMS:
            row["rate"] += f", {_bytes(inputs) / (ours * 1e-3) / 1e12:.2f} TB/s"
        print(" | ".join(str(v) for v in row.values()), flush=True)
        rows.append(row)
        if save is not None:  # after every row: a run stopped by a time limit keeps what it measured
            save(rows)
        del inputs
        timing_s += time.monotonic() - t0
    return rows


def _build_spec(name, cases, jobs) -> dict[str, str]:
    """Build one spec's shapes in ``jobs`` processes (spec by spec, so a run stopped by a time
    limit has timed the specs it built); returns {(spec, shape): error} for the builds that failed."""
    t0 = time.monotonic()
    with ProcessPoolExecutor(max_workers=min(jobs, len(cases)),
                             mp_context=__import__("multiprocessing").get_context("spawn")) as ex:
        errors = dict(ex.map(_prebuild, cases))
    print(f"built {name}: {len(cases)} shapes in {time.monotonic() - t0:.0f} s", flush=True)
    return {(name, k): v for k, v in errors.items() if v}


def _call(kernel, inputs):
    return lambda: kernel(**inputs)


def _peer(spec, case, inputs, config):
    """torch's own operation for the spec where there is one, else its reference on these inputs."""
    try:
        return spec_peer(spec.name, inputs, config, causal=bool(case.get("causal", False)))
    except KeyError:
        return "PyTorch reference", lambda: spec.run_reference(inputs, case)


def _timed(fns: dict, rounds: int) -> dict[str, list[float]]:
    """``interleaved``, except where one call takes over 20 ms (a reference composite looping in
    Python): then the median of 3 calls, once."""
    slow = {}
    for name, fn in fns.items():
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        slow[name] = time.perf_counter() - t > 0.02
    if not any(slow.values()):
        return interleaved(fns, rounds)
    out = {}
    for name, fn in fns.items():
        if not slow[name]:
            out[name] = interleaved({name: fn}, rounds)[name]
            continue
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        out[name] = [statistics.median(times)]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated specs, or all (default: %(default)s)")
    p.add_argument("--model", default=None, help="v41-flash or v4-flash (default: both)")
    p.add_argument("--shapes", action="append", default=None, metavar="PATTERN",
                   help="keep the model shapes whose name matches (fnmatch, e.g. '*/prefill*'; repeatable)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds a row")
    p.add_argument("--jobs", type=int, default=12, help="processes that build before timing")
    p.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET_S", 500)),
                   help="seconds of timing (after the builds) after which remaining rows are listed as not run")
    p.add_argument("--name", default="bench_model_shapes", help="results file stem")
    args = p.parse_args(argv)
    names = sorted(load_all()) if args.kernels == "all" else [k.strip() for k in args.kernels.split(",") if k.strip()]
    stamp = time.strftime("%Y-%m-%d")

    def save(rows, quiet=True):
        write_results(args.name, [{"config": "", **r, "date": stamp} for r in rows], HEADER, quiet=quiet)

    save(run(names, args.model, args.rounds, args.jobs, args.budget, save, args.shapes), quiet=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
