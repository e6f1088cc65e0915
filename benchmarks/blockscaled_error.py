"""How far the FP8 block-scaled GEMM's fp32-promoted tensor-core sums stray, on the GPU: for the
config a user gets at a few prefill shapes, the error beyond the bf16 rounding (2^-7 of the
result) relative to sum_k |a sa b sb| (``gemm_blockscaled.magnitude``), its worst and 99.99th
percentile, and whether two runs agree bit for bit. ``ACCUMULATION`` in
``duotile/kernels_spec/gemm_blockscaled.py`` is set from it.

    python3 benchmarks/blockscaled_error.py [--shapes v4/wo_a/prefill4096,...]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duotile import codegen  # noqa: E402
from duotile.kernels_spec.gemm_blockscaled import _block, magnitude  # noqa: E402
from duotile.kernels_spec.registry import get  # noqa: E402

SHAPES = ("v4/wo_a/prefill4096", "v4/index_wq_b/prefill4096", "v41/wq_b/prefill4096")
SEED = 20261201031


def measure(shape: str, config: dict | None) -> str:
    spec = get("gemm_blockscaled")
    case = spec.model_cases()[shape]
    x = spec.make_inputs(case, torch.device("cuda"), SEED)
    want = spec.run_reference({k: v.clone() for k, v in x.items()}, case)["c"].double()
    kernel = codegen.compile(spec.kernel, "sm90", config=config, constants=spec.constants_of(case))
    runs = []
    for _ in range(2):
        x["c"].zero_()
        kernel(**x)
        torch.cuda.synchronize()
        runs.append(x["c"].double().clone())
    excess = ((runs[0] - want).abs() - 2.0 ** -7 * want.abs()).clamp_min(0)
    rel = (excess / magnitude(x, _block(case)).clamp_min(1e-30)).flatten()
    q = torch.quantile(rel[::97].float(), 0.9999).item()
    return (f"{shape} config {config or 'as chosen'}: worst 2^{math.log2(max(rel.max().item(), 1e-300)):.2f}, "
            f"99.99% 2^{math.log2(max(q, 1e-300)):.2f} of {rel.numel()} elements; two runs equal: "
            f"{torch.equal(runs[0], runs[1])}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated gemm_blockscaled model shapes")
    args = p.parse_args(argv)
    for shape in args.shapes.split(","):
        for config in (None, {"BK": 32}):
            print(measure(shape, config), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
