"""One launch each of duotile's d128 attention and torch SDPA, for Nsight Compute. Usage on the H200:

    ncu --clock-control none --profile-from-start off --set full -o $OUT/attention \\
        python benchmarks/profile_attention.py [--config k=v ...] [--causal]

Both are run (and checked) once outside the profiled range, then once inside it
(``cudaProfilerStart`` / ``Stop``), so the report holds exactly the two kernels of interest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import attention_build  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--config", nargs="*", default=[], help="knobs over the build case's config, k=v")
    p.add_argument("--causal", action="store_true")
    args = p.parse_args(argv)
    kernel, x, cfg = attention_build("d128_causal" if args.causal else "d128", args.config)
    peer = lambda: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=args.causal)  # noqa: E731
    kernel(**x)
    err = (x["o"].float() - peer().float()).abs().max().item()
    print(f"config {cfg}; max |ours - SDPA| {err:.3g}", flush=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    kernel(**x)
    peer()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
