"""One launch each of a duotile kernel and its torch peer, for Nsight Compute. Usage on the H200:

    ncu --clock-control none --profile-from-start off --set full -o $OUT/attention \\
        python benchmarks/profile_kernel.py [--kernel attention|attention_causal|gemm_fp8] [--config k=v ...]

Both are run (and checked) once outside the profiled range, then once inside it
(``cudaProfilerStart`` / ``Stop``), so the report holds exactly the two kernels of interest.
The peers: SDPA for attention; for fp8, ``torch._scaled_mm`` like for like with the config
(fast accumulation for a config that never promotes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import case_build, scaled_mm_peer  # noqa: E402

CASES = {"attention": ("flash_attention", "d128"), "attention_causal": ("flash_attention", "d128_causal"),
         "gemm_fp8": ("gemm", "fp8_8192")}


def _peer(name: str, x: dict, cfg: dict):
    """(the peer's call, the output of ours to compare with it)"""
    if name.startswith("attention"):
        causal = name.endswith("causal")
        return lambda: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal), x["o"]
    return scaled_mm_peer(x, cfg)[1], x["c"]


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="attention", choices=sorted(CASES))
    p.add_argument("--config", nargs="*", default=[], help="knobs over the build case's config, k=v")
    args = p.parse_args(argv)
    kernel, x, cfg = case_build(*CASES[args.kernel], args.config)
    peer, out = _peer(args.kernel, x, cfg)
    kernel(**x)
    err = (out.float() - peer().float()).abs().max().item()
    print(f"{args.kernel} config {cfg}; max |ours - peer| {err:.3g}", flush=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    kernel(**x)
    peer()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
