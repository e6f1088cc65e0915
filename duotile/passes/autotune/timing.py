"""Timing one kernel call: the loop the tuner and the benchmarks share.

On CUDA: warm-up calls until at least ``warm_ms`` of work has run (so the clocks have left
idle: a 20 microsecond kernel after a pause in compilation otherwise times at idle clocks,
several times too slow), then ``reps`` calls, each after an L2 flush (a 256 MB buffer is
written), timed with CUDA events; the median is returned, in milliseconds. On the CPU the same
loop uses ``time.perf_counter``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 256 * 1024 * 1024
_flush_buffers: dict[str, torch.Tensor] = {}


def flush_l2(device: torch.device) -> None:
    key = str(device)
    if key not in _flush_buffers:
        _flush_buffers[key] = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    _flush_buffers[key].zero_()


def median_ms(fn: Callable[[], object], device: torch.device | str = "cuda", *, warmup: int = 3, reps: int = 20,
              flush: bool = True, warm_ms: float = 100.0) -> float:
    device = torch.device(device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    t0, n = time.perf_counter(), 0
    while n < warmup or (cuda and (time.perf_counter() - t0) * 1e3 < warm_ms):
        fn()
        n += 1
        if n % 16 == 0:
            sync()  # keeps the wall clock honest about the work done
    sync()
    times = []
    for _ in range(reps):
        if not cuda:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        if flush:
            flush_l2(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
