"""Sustained speed: each kernel alone, launched back to back for a few seconds, then timed, with
the SM clock and board power read while it runs. Usage on the H200:

    python benchmarks/sustained.py [--seconds 3] [--rounds 2] [--config k=v ...]

The paired rounds of ``bench_kernels.py`` time two kernels under the same clocks; this says what
each gets on its own once the board has settled under its load (a kernel that draws more power
lowers the clock for itself and for whatever runs next).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import case_build  # noqa: E402


def sustained(fn, seconds: float) -> dict:
    """Launch ``fn`` back to back for ``seconds``; then the mean of 50 launches (events), the SM
    clock (MHz) and power (W) read at the end of the load."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        fn()
    stop.record()
    clock, power = _nvml(torch.cuda.clock_rate), _nvml(torch.cuda.power_draw)
    torch.cuda.synchronize()
    return {"ms": start.elapsed_time(stop) / 50, "sm_mhz": clock, "watts": power and round(power / 1000)}


def _nvml(read):
    """An NVML reading through torch, or None where NVML is missing."""
    try:
        return read()
    except Exception:  # no pynvml / NVML on this machine: the timing still stands
        return None


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", nargs="*", default=[])
    args = p.parse_args(argv)
    kernel, x, cfg = case_build("flash_attention", "d128", args.config)
    flops = 4.0 * 4 * 32 * 4096 * 4096 * 128
    fns = {"torch SDPA": lambda: F.scaled_dot_product_attention(x["q"], x["k"], x["v"]),
           f"duotile {cfg}": lambda: kernel(**x)}
    for r in range(args.rounds):
        for name, fn in fns.items():
            got = sustained(fn, args.seconds)
            print(f"round {r} {name}: {got['ms']:.4f} ms, {flops / got['ms'] / 1e9:.1f} TFLOP/s, "
                  f"SM {got['sm_mhz']} MHz, {got['watts']} W", flush=True)


if __name__ == "__main__":
    main()
