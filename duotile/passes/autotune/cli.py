"""``duotile tune KERNEL --target sm90 --shape NAME=VALUE ... [--budget quick|default|full]``.

Everything the command line can get wrong (kernel, target, sizes, pins, where the report goes, a
target this machine cannot measure on) is checked before the sweep starts.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

RESERVED_FIELDS = ("config", "config_for")  # what a spec case may carry besides sizes and options


def _pair(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    if not k.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r} (no name)")
    return k.strip(), v.strip()


def _pairs(text: str) -> dict[str, str]:
    """``NAME=VALUE,NAME=VALUE`` (``--also-try``)."""
    return dict(_pair(kv) for kv in text.split(",") if kv.strip())


def _value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def default_out_dir() -> Path:
    """Where reports and plots go without ``--out``: the cache, never the working directory."""
    from ...codegen.build import cache_root

    return cache_root() / "tune"


def register(subparsers) -> None:
    from .strategies import BUDGETS

    budgets = "; ".join(f"{b.name}: up to {b.max_candidates} candidates" for b in BUDGETS.values()
                        if b.max_candidates)  # shortlist searches nothing: its list is described below
    p = subparsers.add_parser("tune", help="autotune a kernel for a target (measured on sm90, modelled on "
                              "sm100 / ascend950)",
                              description="Autotune a kernel for one case. sm90 compiles, verifies and times "
                              "every candidate on a CUDA GPU; sm100 and ascend950 need no GPU: their "
                              "candidates are ranked by a cost model and compiled best-first. The best config "
                              "goes to the tuning cache, which `duotile build` reads.")
    p.add_argument("kernel", help="a kernel spec name (see `duotile list`)")
    p.add_argument("--target", default="sm90", metavar="T",
                   help="sm90 (measured on a CUDA GPU), sm100 or ascend950 (cost model, compile only), "
                        "interpret (PyTorch on the CPU)")
    p.add_argument("--shape", type=_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="a case field: a size (M=8192) or an option (dtype=f8e4m3, causal=true); repeatable, "
                        "over --case")
    p.add_argument("--case", metavar="CASE", help="start from a named case or build case of the spec "
                   "(default: none, every size from --shape)")
    p.add_argument("--model", default=None, choices=("v41-flash", "v4-flash"),
                   help="tune every shape this model needs (the spec's model shapes, one sweep per shape "
                        "bucket) instead of one case; --budget defaults to quick then")
    p.add_argument("--shapes", action="append", default=[], metavar="PATTERN",
                   help="with --model: only the model shapes whose name matches (fnmatch, e.g. '*/prefill*' or "
                        "'v41/wq_b/*'; repeatable; shape names are <model>/<what>/<phase>) (default: every shape)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="with --model and --budget shortlist: build every bucket's candidates first, in N "
                        "processes (default: 1, each candidate built when its bucket is measured)")
    p.add_argument("--ship", action="store_true",
                   help="with --model: write the results into the table shipped with duotile "
                        "(duotile/tuned/tuning.json) instead of the user's tuning cache")
    p.add_argument("--budget", default=None, choices=tuple(BUDGETS),
                   help=f"how much to try ({budgets}; shortlist: the default and up to 8 configs fixed before any "
                        f"measurement, for --model sweeps on a GPU); default: default, or quick with --model")
    p.add_argument("--strategy", default="auto", choices=("auto", "exhaustive", "random", "pattern"),
                   help="search over the space; auto: exhaustive where the space fits the budget, else "
                        "pattern search (sm100 / ascend950 always rank by the cost model)")
    p.add_argument("--pin", type=_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="fix a tunable or target knob, e.g. --pin BM=128 (repeatable)")
    p.add_argument("--also-try", type=_pairs, action="append", default=[], metavar="NAME=VALUE,...",
                   help="a start point measured after the default (over it), e.g. "
                        "'BN=256,warp_specialize=manual'; the search continues from the best (repeatable)")
    p.add_argument("--require", action="append", default=[], metavar="RELATION",
                   help="an extra constraint, e.g. 'Mod(K, BK) == 0' (repeatable)")
    p.add_argument("--device", default=None,
                   help="torch device to measure on (default: the target's, cuda for sm90)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and of random search")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the JSON report and the PNG plot (default: $DUOTILE_CACHE/tune, "
                        "~/.cache/duotile/tune)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="tuning cache folder (default: $DUOTILE_CACHE, ~/.cache/duotile)")
    p.add_argument("--no-cache", action="store_true", help="do not write the tuning cache")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


# -- checks made before the sweep ------------------------------------------------------------------
def size_names(spec) -> list[str]:
    """The kernel's symbolic dimensions (the sizes a case gives)."""
    dims: list[str] = []
    for t in spec.kernel.tensors.values():
        dims += [d for d in t.dims if isinstance(d, str) and d not in dims]
    first = next(iter([*spec.build_cases.values(), *spec.cases.values()]), {})
    return [d for d in first if d in dims] + [d for d in dims if d not in first]  # in the cases' order


def option_names(spec) -> list[str]:
    """Case fields that are not sizes (dtype, causal, ...), as the spec's own cases use them."""
    sizes, names = set(size_names(spec)), []
    for case in [*spec.cases.values(), *spec.build_cases.values()]:
        names += [k for k in case if k not in sizes and k not in RESERVED_FIELDS and k not in names]
    return names


def _fields(spec) -> str:
    opts = option_names(spec)
    return f"sizes {', '.join(size_names(spec))}" + (f"; options {', '.join(opts)}" if opts else "")


def resolve_case(spec, case_name: str | None, shape: list[tuple[str, str]]) -> dict:
    """The case to tune: ``--case`` with ``--shape`` over it; every size a whole number >= 1."""
    case: dict = {}
    if case_name:
        named = spec.cases.get(case_name, spec.build_cases.get(case_name))
        if named is None:
            raise KeyError(f"{spec.name} has no case {case_name!r}; cases: "
                           f"{', '.join([*spec.cases, *spec.build_cases])}")
        case = dict(named)
    if not case and not shape:
        raise ValueError(f"give --case or --shape NAME=VALUE for every size: {spec.name} has {_fields(spec)} "
                         f"(e.g. {' '.join(f'--shape {k}=...' for k in size_names(spec))}); "
                         f"cases: {', '.join([*spec.cases, *spec.build_cases])}")
    sizes, options = size_names(spec), option_names(spec)
    for name, text in shape:
        if name not in sizes and name not in options:
            raise KeyError(f"--shape {name}: {spec.name} has no such field; it has {_fields(spec)}")
        case[name] = _value(text)
    missing = [k for k in sizes if k not in case]
    if missing:
        raise ValueError(f"--shape: no size for {', '.join(missing)}; {spec.name} needs every one of "
                         f"{', '.join(sizes)}")
    for name in sizes:
        v = case[name]
        if isinstance(v, float) and v.is_integer():
            v = case[name] = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"--shape {name}={v}: a size is a whole number of 1 or more")
    return case


def check_target(name: str, device: str | None):
    """The target's object; refuses one that measures on a GPU where this machine has none."""
    from ...codegen.target import get_target, target_names

    if name not in target_names():
        raise KeyError(f"unknown target {name!r}; known: {', '.join(target_names())}")
    tgt = get_target(name)
    if tgt.modelled:
        return tgt
    dev = device or tgt.runs_on
    if dev.startswith("cuda"):
        import torch

        modelled = [t for t in target_names() if get_target(t).modelled]
        alt = f"; the compile-only targets {' and '.join(modelled)} tune without one, ranked by a cost model " \
              f"(--target {modelled[0]})" if modelled else ""
        if not torch.cuda.is_available():
            raise RuntimeError(f"target {name} measures every candidate on a CUDA GPU and this machine has none "
                               f"(torch {torch.__version__}, torch.cuda.is_available() is False){alt}")
        index = torch.device(dev).index
        if index is not None and index >= torch.cuda.device_count():
            raise ValueError(f"--device {dev}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return tgt


def check_pins(spec, tgt, pins: list[tuple[str, str]]) -> None:
    """Each ``--pin`` names a tunable of the kernel or a knob of the target, with one of its values."""
    from ...dsl.errors import DslError
    from .space import parse_value

    spaces = {**spec.kernel.tunables, **tgt.knobs}
    for name, text in pins:
        if name not in spaces:
            raise KeyError(f"--pin {name}: {spec.name} has no tunable {name!r} and {tgt.name} no such knob; "
                           f"tunables: {', '.join(spec.kernel.tunables) or '-'}; "
                           f"{tgt.name} knobs: {', '.join(tgt.knobs) or '-'}")
        space = spaces[name]
        try:
            value = parse_value(space, text) if not space.accepts(text) else text
        except DslError:
            value = None
        if value is None or not space.accepts(value):
            raise ValueError(f"--pin {name}={text}: not {space.allowed()}")


def writable_dir(path: Path, flag: str) -> Path:
    """``path`` as a folder that exists and can be written, or an error naming ``flag``."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{flag} {path}: is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(f"{flag} {path}: cannot create the folder ({err.strerror or err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{flag} {path}: the folder is not writable")
    return path


def run(args) -> int:
    from ...kernels_spec import registry
    from . import report
    from .tuner import tune

    spec = registry.get(args.kernel)
    if args.model:
        return run_model(spec, args)
    if args.ship:
        raise ValueError("--ship writes a whole model's sweep into the shipped table: give --model too")
    if args.shapes or args.jobs != 1:
        flag = "--shapes" if args.shapes else "--jobs"
        raise ValueError(f"{flag} picks and builds a model's shapes: give --model too")
    if args.budget == "shortlist":
        raise ValueError("--budget shortlist measures a list made for each of a model's shapes: give --model too")
    case = resolve_case(spec, args.case, args.shape)
    tgt = check_target(args.target, args.device)
    check_pins(spec, tgt, args.pin)
    out = writable_dir(Path(args.out).expanduser() if args.out else default_out_dir(), "--out")
    if args.cache_dir and not args.no_cache:
        writable_dir(Path(args.cache_dir).expanduser(), "--cache-dir")

    result = tune(spec, case, args.target, budget=args.budget or "default", strategy=args.strategy,
                  pins=dict(args.pin),
                  device=args.device, seed=args.seed, relations=args.require, cache_dir=args.cache_dir,
                  write_cache=not args.no_cache, progress=not args.no_progress, also_try=args.also_try)
    print(report.summary(result))
    for line in report.write_all(result, out, fallback=default_out_dir()):
        print(f"  {line}")
    if getattr(result, "saved", None):
        print(f"  {'cache:':<8}{result.saved}")
    if getattr(result, "interrupted", False):
        return 130  # what was measured is reported and saved; the exit status still says Ctrl-C
    return 0 if result.best is not None else 1


def run_model(spec, args) -> int:
    """``--model``: every shape bucket the model needs, one quick sweep each, one table."""
    from . import model_sweep

    if args.case or args.shape or args.pin or args.also_try:
        raise ValueError("--model tunes the spec's own model shapes: drop --case, --shape, --pin and --also-try")
    tgt = check_target(args.target, args.device)
    if not spec.model_cases(args.model):
        raise ValueError(f"{spec.name} declares no shapes for {args.model}")
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: give 1 or more processes")
    if args.budget == "shortlist" and tgt.modelled:
        raise ValueError(f"--budget shortlist is a list for a measurement to choose from; {tgt.name} ranks by a "
                         "cost model: use --budget quick")
    if not model_sweep.plan(spec, args.model, args.shapes):
        names = list(spec.model_cases(args.model))
        raise ValueError(f"--shapes {' '.join(args.shapes)}: no {args.model} shape of {spec.name} matches; it has "
                         f"{len(names)}, e.g. {', '.join(names[:4])}")
    runs = model_sweep.sweep(spec, args.model, args.target, budget=args.budget or "quick", ship=args.ship,
                             cache_dir=None if args.no_cache else args.cache_dir, progress=not args.no_progress,
                             seed=args.seed, shapes=args.shapes or None, jobs=args.jobs)
    print(model_sweep.table(runs))
    where = model_sweep.SHIPPED if args.ship else "the tuning cache"
    print(f"  {sum(r.result is not None and r.result.best is not None for r in runs)} of {len(runs)} shape buckets "
          f"tuned; written to {where}")
    return 0 if all(r.result is not None and r.result.best is not None for r in runs) else 1
