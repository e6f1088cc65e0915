"""Sparse decode's split against the batch on an sm90 GPU (H200 or H100): a sparse decode kernel (``--kernel``:
``sparse_mqa_decode``, or the stored-row ``sparse_mqa_decode_fp8`` / ``_fp8_nope``) at its CSA / CSA2
model shapes (640 rows a query, decode batches 1, 16, 64) and V4's HCA rows (8,320) at batches 1 and
16, for a few pinned configs (``SPLIT`` ranges of ``BN``-row blocks) and the config a user gets.
Each config is one build (B, L and N are dynamic); each cell is checked against the reference
(``!WRONG`` marks a mismatch) and timed (median of 20 flushed calls, microseconds).

The kernel is batch invariant, so one config serves every batch: more ranges fill the GPU at
batch 1, fewer write less partial output at batch 64. This table is what the shipped starting
config (``duotile/tuned/starting.json``) is chosen from.

    python3 benchmarks/sparse_decode_configs.py [--kernel sparse_mqa_decode] [--splits 1,4,8,16,32] [--bn 64,32]
        [--jobs 8] [--gather-pipeline]

Results go to ``results/sparse_decode_configs.md`` (the BF16-row kernel) or
``results/sparse_decode_configs_<kernel>.md``.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.config_grid import time_configs  # noqa: E402
from duotile.kernels_spec.registry import load_all  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--splits", default="1,4,8,16,32", help="SPLIT values to pin (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=8, help="build threads (default: %(default)s)")
    p.add_argument("--kernel", default="sparse_mqa_decode",
                   choices=("sparse_mqa_decode", "sparse_mqa_decode_fp8", "sparse_mqa_decode_fp8_nope"))
    p.add_argument("--gather-pipeline", action="store_true",
                   help="also each config with gather_pipeline on")
    p.add_argument("--bn", default="64", help="block sizes (slots a block), each with every split "
                   "(default: %(default)s)")
    p.add_argument("--bd", default="128", help="the combine's output columns a block, each with every "
                   "split and block size (default: %(default)s)")
    p.add_argument("--shapes", action="append", metavar="PATTERN",
                   help="model shapes to time (fnmatch, repeatable; default: CSA's, HCA's at batches 1 and 16)")
    p.add_argument("--name", help="results file stem (default: sparse_decode_configs[_KERNEL])")
    args = p.parse_args(argv)
    spec = load_all()[args.kernel]
    shapes = [s for s in spec.model_shapes if any(fnmatch.fnmatch(s, pat) for pat in args.shapes)] if args.shapes \
        else [s for s in spec.model_shapes if "csa" in s or s.endswith(("hca8320/decode1", "hca8320/decode16"))]
    if not shapes:
        p.error(f"no model shape of {args.kernel} matches {args.shapes}: {', '.join(spec.model_shapes)}")
    configs: list[dict | None] = [dict(BN=int(bn), STAGES=2, SPLIT=int(s), BD=int(bd)) for bn in args.bn.split(",")
                                  for s in args.splits.split(",") for bd in args.bd.split(",")]
    if args.gather_pipeline:  # each split again with the gather loop pipelined (the sm90 knob)
        configs += [{**c, "gather_pipeline": True} for c in list(configs)]
    configs.append(None)  # the config a user gets
    name = args.name or "sparse_decode_configs" + ("" if args.kernel == "sparse_mqa_decode" else "_" + args.kernel)
    time_configs(spec, shapes, configs, name, args.jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
