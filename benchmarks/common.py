"""Timing and reporting shared by the benchmarks (GPU only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from duotile.passes.autotune.timing import median_ms

# H200 SXM datasheet peaks (dense) and this project's measured ceilings (KINDS.md, the brief)
PEAK = {"bf16_tflops": 989.0, "fp8_tflops": 1979.0, "hbm_tbs": 4.8}
MEASURED = {"bf16_tflops": 785.0, "fp8_tflops": 1261.0, "copy_tbs": 4.2}


def bench(fn, warmup: int = 5, reps: int = 20, flush: bool = True) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs, each after an L2 flush, after a warm-up
    of at least 100 ms (the tuner's loop: ``duotile.passes.autotune.timing``)."""
    return median_ms(fn, "cuda", warmup=warmup, reps=reps, flush=flush)


def copy_bandwidth(nbytes: int) -> float:
    """Measured device-to-device copy bandwidth (TB/s, read + write counted) for ``nbytes``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def write_results(name: str, rows: list[dict], header: list[str]) -> Path:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    device = torch.cuda.get_device_name()
    (out / f"{name}.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    lines = [f"device: {device}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(r.get(h, "")) for h in header) + " |" for r in rows]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    extra = os.environ.get("OUT")
    if extra:
        for suffix in (".json", ".md"):
            Path(extra, f"{name}{suffix}").write_text((out / f"{name}{suffix}").read_text())
    print("\n".join(lines))
    return out / f"{name}.md"
