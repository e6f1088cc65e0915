"""``duotile tune KERNEL --target sm90 --shape NAME=VALUE ... [--budget quick|default|full]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _pair(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    return k.strip(), v.strip()


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help="autotune a kernel for a target (measured on sm90, modelled on "
                              "sm100 / ascend950)")
    p.add_argument("kernel")
    p.add_argument("--target", default="sm90")
    p.add_argument("--shape", type=_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="a case field (sizes, dtype=f8e4m3, causal=true); overrides --case")
    p.add_argument("--case", help="start from a named case or build case of the spec")
    p.add_argument("--budget", default="default", choices=("quick", "default", "full"))
    p.add_argument("--strategy", default="auto", choices=("auto", "exhaustive", "random", "pattern"))
    p.add_argument("--pin", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--also-try", action="append", default=[], metavar="NAME=VALUE,...",
                   help="a start point measured after the default (over it), e.g. "
                        "'BN=256,warp_specialize=manual'; the search continues from the best")
    p.add_argument("--require", action="append", default=[], metavar="RELATION",
                   help="an extra constraint, e.g. 'Mod(K, BK) == 0'")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="tune_results", help="folder for the JSON report and the plot")
    p.add_argument("--cache-dir", default=None, help="tuning cache folder (default: $DUOTILE_CACHE)")
    p.add_argument("--no-cache", action="store_true", help="do not write the tuning cache")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from ...kernels_spec import registry
    from . import report
    from .tuner import tune

    spec = registry.get(args.kernel)
    case: dict = {}
    if args.case:
        case = dict(spec.cases.get(args.case) or spec.build_cases.get(args.case) or {})
        if not case:
            raise SystemExit(f"{args.kernel} has no case {args.case!r}; cases: "
                             f"{', '.join([*spec.cases, *spec.build_cases])}")
    case.update({k: _value(v) for k, v in args.shape})
    if not case:
        raise SystemExit("give --case or --shape NAME=VALUE for every size of the kernel")
    try:
        result = tune(spec, case, args.target, budget=args.budget, strategy=args.strategy, pins=dict(args.pin),
                      device=args.device, seed=args.seed, relations=args.require, cache_dir=args.cache_dir,
                      write_cache=not args.no_cache, progress=not args.no_progress,
                      also_try=[dict(_pair(kv) for kv in text.split(",")) for text in args.also_try])
    except ValueError as err:  # a start point outside the space: say which, no traceback
        print(f"duotile tune: {err}", file=sys.stderr)
        return 2
    print(report.summary(result))
    stem = Path(args.out) / f"{result.kernel}_{result.target}"
    print(f"  report: {report.write_json(result, stem.with_suffix('.json'))}")
    print(f"  plot:   {report.plot(result, stem.with_suffix('.png'))}")
    return 0 if result.best is not None else 1
