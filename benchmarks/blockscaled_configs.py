"""The block-scaled GEMM's config against its shape on the H200: ``gemm_blockscaled`` at 64 decode
rows and a 4,096-row prefill chunk of the dense projections named below, for two pinned
hand-scheduled configs and the config a user gets. Each config is one build a shape (M is dynamic);
each cell is checked against the reference (``!WRONG`` marks a mismatch) and timed (median of 20
flushed calls, microseconds).

The kernel is batch invariant, so one config serves decode and prefill alike: a config is worth
shipping only where it is not slower at decode. This table is what the shipped starting configs
of ``gemm_blockscaled`` (``duotile/tuned/starting.json``) are chosen from.

    python3 benchmarks/blockscaled_configs.py [--projections v41/wq_b,v4/wo_b] [--jobs 15]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench, write_results  # noqa: E402
from duotile import codegen  # noqa: E402
from duotile.kernels_spec.compare import mismatch  # noqa: E402
from duotile.kernels_spec.registry import load_all  # noqa: E402

MANUAL = {"warp_specialize": "manual", "SPLIT": 1, "BK": 128}
CONFIGS = {  # two hand-scheduled tiles: two consumer warp groups on 128 rows, one on 64
    "128x128, 2 warp groups": {**MANUAL, "BM": 128, "BN": 128, "STAGES": 3, "threads": 256},
    "64x128, 1 warp group": {**MANUAL, "BM": 64, "BN": 128, "STAGES": 4, "threads": 128},
    "user": None,  # the config a user gets
}
PROJECTIONS = "v41/wq_b,v41/wo_b,v41/shared_w13,v41/wkv,v4/wq_b,v4/wo_b,v4/shared_w13,v4/wkv"


def projection_rows(spec, proj: str, jobs: int) -> list[dict]:
    """One row a config: the projection's decode and prefill times (one build serves both)."""
    cases = spec.model_cases()
    shapes = [f"{proj}/decode64", f"{proj}/prefill4096"]
    consts = spec.constants_of(cases[shapes[0]])
    kernels = {name: codegen.compile(spec.kernel, "sm90", config=c, constants=consts) for name, c in CONFIGS.items()}
    inputs = {s: spec.make_inputs(cases[s], torch.device("cuda"), 0) for s in shapes}
    refs = {s: spec.run_reference(inputs[s], cases[s]) for s in shapes}
    with ThreadPoolExecutor(jobs) as pool:  # compile in parallel: a build happens at the first call
        list(pool.map(lambda k: k.artifacts(**inputs[shapes[0]]), kernels.values()))
    rows = []
    for name, k in kernels.items():
        row = {"projection": proj, "config": name if name != "user" else
               "user: " + str(k.artifacts(**inputs[shapes[0]])[0].meta.get("config"))}
        for s in shapes:
            k(**inputs[s])
            torch.cuda.synchronize()
            bad = mismatch(spec, cases[s], inputs[s], refs[s])
            us = bench(lambda k=k, s=s: k(**inputs[s]), reps=20) * 1000
            row[s.rsplit("/", 1)[1]] = f"{us:.1f}{'' if bad is None else ' !WRONG'}"
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--projections", default=PROJECTIONS, help="model/projection names (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=15, help="build threads (default: %(default)s)")
    args = p.parse_args(argv)
    spec = load_all()["gemm_blockscaled"]
    rows = [r for proj in args.projections.split(",") for r in projection_rows(spec, proj, args.jobs)]
    write_results("blockscaled_configs", rows, ["projection", "config", "decode64", "prefill4096"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
