"""The decode GEMM's chosen config against its neighbours on the H200: for a few model shapes at
one row, the config a user gets (``codegen/choose_config.py``) and variants of its K step, stages
and split, timed interleaved against ``F.linear`` / ``torch._scaled_mm``. It checks the cost
model's ranking where the model is weakest (a few blocks streaming weights).

Each row gives the wall time of a call as a user makes it (CUDA events around the call, after
an L2 flush: host time between the launches of a two-phase kernel counts), the GPU time of its
launches alone (torch.profiler, 10 flushed calls), and the cost model's estimate. ``--grid``
widens the variants to a grid of tile width, K step, stages, split and threads.

    python3 benchmarks/decode_gemm_configs.py [--shapes v41/wq_a/decode1,...] [--jobs 14] [--grid] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import interleaved, spec_peer  # noqa: E402
from duotile import codegen  # noqa: E402
from duotile.codegen.choose_config import explain_choice  # noqa: E402
from duotile.kernels_spec.registry import load_all  # noqa: E402

SHAPES = ("v41/wq_a/decode1", "v41/wo_b/decode1", "v41/shared_w13/decode16", "v41/compressor_ratio1/decode1")


def variants(chosen: dict) -> list[dict]:
    out = [dict(chosen)]
    for bk in (32, 64, 128):
        for stages in (2, 4):
            out.append({**chosen, "BK": bk, "STAGES": stages})
    for split in (chosen["SPLIT"] // 2, chosen["SPLIT"] * 2):
        if 1 <= split <= 32:
            out.append({**chosen, "SPLIT": split})
    seen, unique = set(), []
    for c in out:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


GRID = {"BN": (32, 64), "BK": (64, 128), "STAGES": (3, 5), "SPLIT": (4, 8, 16)}


def grid_variants(chosen: dict) -> list[dict]:
    """The chosen config, then every point of ``GRID`` (the other tunables as chosen), then the
    chosen config at 128 threads."""
    import itertools

    out = [dict(chosen)]
    for values in itertools.product(*GRID.values()):
        out.append({**chosen, **dict(zip(GRID, values))})
    out.append({**chosen, "threads": 128})
    return list({tuple(sorted(c.items())): c for c in out}.values())


def gpu_us(kernel, inputs: dict, calls: int = 10) -> float:
    """Microseconds of GPU time a call: ``calls`` calls, each after an L2 flush, replayed from a
    CUDA graph (no host time between launches), less the same graph's flushes alone."""
    from duotile.passes.autotune.timing import flush_l2

    device = torch.device("cuda")

    flush_l2(device)  # its buffer exists before the capture

    def replay_ms(with_call: bool) -> float:
        stream = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            kernel(**inputs)  # warm on the capture stream
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    flush_l2(device)
                    if with_call:
                        kernel(**inputs)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 5

    return (replay_ms(True) - replay_ms(False)) / calls * 1e3


def model_us(spec, case: dict, config: dict) -> float:
    """The cost model's estimate of ``config`` at ``case`` (sm90's machine)."""
    from duotile.codegen.target import get_target
    from duotile.passes.autotune.constraints import Constraints
    from duotile.passes.autotune.cost_model import estimate_phases

    sig = spec.kernel.bind(spec.meta_inputs(case))
    verdict = Constraints(spec.kernel, sig, "sm90").check(config, full=False)
    knobs = {k: v for k, v in config.items() if k not in spec.kernel.tunables}
    if not verdict.ok:
        return float("nan")
    return estimate_phases(verdict.phases, get_target("sm90").machine, knobs).time_s * 1e6


def _build(job):
    shape, config = job
    spec = load_all()["gemm"]
    case = spec.model_cases()[shape]
    try:
        kernel = codegen.compile(spec.kernel, "sm90", config=config)
        kernel(**spec.make_inputs(case, torch.device("cuda"), 0))
        torch.cuda.synchronize()
        return ""
    except Exception as err:  # noqa: BLE001 - reported in the row
        return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"


def profile(shape: str) -> None:
    """Where a call's time goes: each launch's GPU time (torch.profiler), the wall time of a
    call back to back (no flush) and of the same call replayed from a CUDA graph."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    spec = load_all()["gemm"]
    case = spec.model_cases()[shape]
    inputs = spec.make_inputs(case, torch.device("cuda"), 0)
    kernel = codegen.compile(spec.kernel, "sm90")
    for _ in range(3):
        kernel(**inputs)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            kernel(**inputs)
        torch.cuda.synchronize()
    print(f"-- {shape}: the 20 calls' launches")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
    t0 = time.perf_counter()
    for _ in range(200):
        kernel(**inputs)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / 200 * 1e6
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernel(**inputs)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            kernel(**inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    print(f"{shape}: {eager:.1f} us a call back to back, {(time.perf_counter() - t0) / 200 * 1e6:.1f} us from a graph")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated gemm model shapes")
    p.add_argument("--jobs", type=int, default=14, help="processes that build before timing")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--profile", action="store_true", help="profile the chosen config of each shape instead")
    p.add_argument("--grid", action="store_true", help="time the grid GRID around the chosen config")
    args = p.parse_args(argv)
    if args.profile:
        for shape in args.shapes.split(","):
            profile(shape)
        return 0
    spec = load_all()["gemm"]
    jobs = []
    for shape in args.shapes.split(","):
        case = spec.model_cases()[shape]
        sig = spec.kernel.bind(spec.meta_inputs(case))
        chosen = explain_choice(spec.kernel, "sm90", sig)[0] or spec.kernel.default_config()
        chosen = {k: v for k, v in chosen.items() if k in spec.kernel.tunables}
        jobs += [(shape, c) for c in (grid_variants if args.grid else variants)(chosen)]
    with ProcessPoolExecutor(args.jobs, mp_context=__import__("multiprocessing").get_context("spawn")) as ex:
        errors = list(ex.map(_build, jobs))
    print("shape | config | ours us | peer us | peer/ours | ours GPU us | model us")
    for (shape, config), err in zip(jobs, errors):
        if err:
            print(f"{shape} | {config} | {err}")
            continue
        case = spec.model_cases()[shape]
        inputs = spec.make_inputs(case, torch.device("cuda"), 0)
        kernel = codegen.compile(spec.kernel, "sm90", config=config)
        _, peer = spec_peer("gemm", inputs, config)
        t = interleaved({"peer": peer, "ours": lambda k=kernel, x=inputs: k(**x)}, args.rounds)
        ours, theirs = statistics.median(t["ours"]), statistics.median(t["peer"])
        print(f"{shape} | {config} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {theirs / ours:.3f} | "
              f"{gpu_us(kernel, inputs):.1f} | {model_us(spec, case, config):.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
