"""Any spec's configs against its model shapes on an sm90 GPU (H200 or H100): every combination of
the ``--grid`` values (tunables or sm90 knobs), each with the kernel's other parameters at their
defaults (pin them with a one-value ``--grid``), and the config a user gets, at the model shapes
``--shapes`` matches. Each config is built for every shape first (``--jobs`` threads); each cell
is checked against the spec's reference (``!WRONG`` marks a mismatch) and timed (median of 20
calls, each after an L2 flush, in microseconds). A config the space, a capacity check or the
toolchain refuses is a cell that says so.

    python3 benchmarks/config_grid.py router --shapes 'v41/*/decode*' --grid threads=32,64,128,256 \\
        --grid ROWS=1,4 [--jobs 8] [--name STEM]

Results go to ``results/config_grid_<spec>.md`` (or ``--name``): the table a shipped starting
config (``duotile/tuned/starting.json``) is chosen from.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench, write_results  # noqa: E402
from duotile import codegen  # noqa: E402
from duotile.kernels_spec.compare import mismatch  # noqa: E402
from duotile.kernels_spec.registry import load_all  # noqa: E402


def parse_grid(items: list[str]) -> list[dict]:
    """``NAME=V1,V2`` items -> every combination, values read as JSON where they parse (ints,
    booleans) and as strings otherwise."""
    axes = []
    for item in items:
        name, _, values = item.partition("=")
        if not name or not values:
            raise ValueError(f"--grid {item!r}: expected NAME=V1,V2,...")
        axes.append([(name, _value(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else []


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def time_configs(spec, shapes: list[str], configs: list[dict | None], name: str, jobs: int = 8,
                 target: str = "sm90", device: str = "cuda", timer=bench, write=write_results) -> list[dict]:
    """One row a config (None: the config a user gets) and a cell a model shape: each built first
    (``jobs`` threads), then checked against the reference and timed (``timer(fn, reps=20)``, ms);
    the rows written (``write``: to ``results/NAME.{md,json}``) after each, so a run cut short
    keeps them."""
    dev = torch.device(device)
    inputs = {s: spec.make_inputs(spec.model_shapes[s], dev, 1) for s in shapes}
    refs = {s: spec.run_reference(inputs[s], spec.model_shapes[s]) for s in shapes}
    consts = {s: spec.constants_of(spec.model_shapes[s]) for s in shapes}
    kernels: dict = {}

    def build(key):
        i, s = key
        try:  # a value the space refuses fails here, a config the target refuses in the build
            kernels[key] = codegen.compile(spec.kernel, target, config=configs[i], constants=consts[s])
            kernels[key].artifacts(**inputs[s])
        except Exception as err:  # noqa: BLE001 - a refused config is a row that says so
            return f"not built: {type(err).__name__}: {str(err).splitlines()[0][:100]}"
        return None

    keys = [(i, s) for i in range(len(configs)) for s in shapes]
    with ThreadPoolExecutor(jobs) as pool:
        errors = dict(zip(keys, pool.map(build, keys)))
    rows = []
    for i, config in enumerate(configs):
        row = {"config": "user" if config is None else json.dumps(config)}
        for s in shapes:
            if errors[(i, s)]:
                row[s] = errors[(i, s)]
                continue
            k = kernels[(i, s)]
            if config is None:
                row["config"] = f"user: {json.dumps(k.artifacts(**inputs[s])[0].meta.get('config'))}"
            k(**inputs[s])
            if dev.type == "cuda":
                torch.cuda.synchronize()
            bad = mismatch(spec, spec.model_shapes[s], inputs[s], refs[s])
            us = timer(lambda k=k, s=s: k(**inputs[s]), reps=20) * 1000
            row[s] = f"{us:.1f}{'' if bad is None else ' !WRONG'}"
        rows.append(row)
        print(row, flush=True)
        write(name, rows, ["config", *shapes], quiet=True)
    write(name, rows, ["config", *shapes])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spec", help="a kernel spec name (duotile list)")
    p.add_argument("--shapes", action="append", required=True, metavar="PATTERN",
                   help="model shapes to time (fnmatch, repeatable)")
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2",
                   help="values of one tunable or knob; every combination is a config (repeatable)")
    p.add_argument("--jobs", type=int, default=8, help="build threads (default: %(default)s)")
    p.add_argument("--name", help="results file stem (default: config_grid_SPEC)")
    args = p.parse_args(argv)
    specs = load_all()
    if args.spec not in specs:
        p.error(f"no spec {args.spec!r}; the specs: {', '.join(sorted(specs))}")
    try:
        grid = parse_grid(args.grid)
    except ValueError as err:
        p.error(str(err))
    spec = specs[args.spec]
    shapes = [s for s in spec.model_shapes if any(fnmatch.fnmatch(s, pat) for pat in args.shapes)]
    if not shapes:
        p.error(f"no model shape of {args.spec} matches {args.shapes}: {', '.join(spec.model_shapes)}")
    if not torch.cuda.is_available():
        p.error("times sm90 builds on a CUDA GPU, and this machine has none (duotile show / build compile "
                "them without one)")
    time_configs(spec, shapes, [*grid, None], args.name or f"config_grid_{args.spec}", args.jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
