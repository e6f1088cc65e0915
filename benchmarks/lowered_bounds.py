"""Every sm90 / sm100 build a user meets at the model's shapes (and, with ``--sweep``, at the GPU
shape sweep's seeded random shapes), lowered by TileLang without nvcc and its global loads and
stores proven inside their tensors (``codegen/tilelang_cuda/lowered_bounds.py``, the check every
full build runs): a table of each spec and target, and every access not proven. No GPU needed.

    python3 benchmarks/lowered_bounds.py --jobs 2                      # every model shape, sm90 and sm100
    python3 benchmarks/lowered_bounds.py --target sm90 --sweep 20261207 --no-model-shapes

Calls that differ only in a dynamic size share one build and are lowered once. The config is the
one a user gets (no config given).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = ("sm90", "sm100")


def cases(model_shapes: bool, sweep: int | None) -> list[tuple[str, str, dict]]:
    """(spec, label, case) of each model shape and, with ``sweep``, of each random sweep case."""
    from duotile.kernels_spec import load_all

    out = []
    if model_shapes:
        out += [(name, shape, case) for name, spec in sorted(load_all().items())
                for shape, case in spec.model_shapes.items()]
    if sweep is not None:
        os.environ["DUOTILE_SWEEP_SEED"] = str(sweep)
        from tests.gpu.test_shape_sweep import sweep_cases

        out += [(name, label, case) for name, label, case, _ in sweep_cases() if label.startswith("random")]
    return out


def build_key(name: str, case: dict, target: str) -> tuple:
    """Calls of one build: a dynamic size's value is not part of it (whether the case names it is)."""
    from duotile.kernels_spec import load_all

    spec = load_all()[name]
    dynamic = set(spec.kernel.dynamic) - set(spec.kernel.bucketed)
    return name, target, tuple(sorted((k, "dynamic" if k in dynamic else str(v)) for k, v in case.items()))


def check_one(job: tuple[str, str, dict, str]) -> dict:
    """Lower one call's build (each phase) and check it: a row of counts, or the error."""
    from duotile.codegen.driver import generate_case
    from duotile.codegen.target import get_target
    from duotile.codegen.tilelang_cuda import toolchain
    from duotile.kernels_spec import load_all

    name, label, case, target = job
    row = {"spec": name, "label": label, "target": target, "phases": 0, "proven": 0, "data": 0, "unproven": []}
    t0 = time.perf_counter()
    try:
        sm = get_target(target).arch.sm
        for art in generate_case(load_all()[name], case, target):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "kernel_tilelang.py"
                path.write_text(art.stages["tilelang"])
                prim, configs = toolchain.load_generated(str(path), art.meta["entry"])
                report = toolchain.lower_checked(prim, sm, configs)[1]
            row["phases"] += 1
            row["proven"] += report.proven
            row["data"] += report.data
            row["unproven"] += [str(a) for a in report.unproven]
    except Exception as err:  # noqa: BLE001 - a refusal or a lowering failure is a row too
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    row["seconds"] = time.perf_counter() - t0
    return row


def table(rows: list[dict]) -> str:
    groups = defaultdict(list)
    for r in rows:
        groups[(r["spec"], r["target"])].append(r)
    lines = ["| spec | target | builds | kernels | accesses proven | indexed by data | not proven | not lowered |",
             "|---|---|---|---|---|---|---|---|"]
    for (spec, target), rs in sorted(groups.items()):
        ok = [r for r in rs if "error" not in r]
        lines.append(f"| {spec} | {target} | {len(rs)} | {sum(r['phases'] for r in ok)} | "
                     f"{sum(r['proven'] for r in ok)} | {sum(r['data'] for r in ok)} | "
                     f"{sum(len(r['unproven']) for r in ok)} | {len(rs) - len(ok)} |")
    return "\n".join(lines)


def details(rows: list[dict]) -> str:
    out = []
    for r in rows:
        for a in r["unproven"]:
            out.append(f"- {r['spec']} {r['label']} {r['target']}: {a}")
        if "error" in r:
            out.append(f"- {r['spec']} {r['label']} {r['target']}: not lowered: {r['error']}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=",".join(TARGETS), help="comma-separated: sm90, sm100 (default both)")
    ap.add_argument("--sweep", type=int, default=None, help="also the GPU sweep's random cases at this seed")
    ap.add_argument("--no-model-shapes", action="store_true", help="leave the model shapes out")
    ap.add_argument("--specs", help="comma-separated spec names (default: every spec)")
    ap.add_argument("--jobs", type=int, default=1, help="processes (default 1)")
    ap.add_argument("--out", help="also write the report (markdown) to this file")
    args = ap.parse_args(argv)
    jobs, seen = [], set()
    only = set(args.specs.split(",")) if args.specs else None
    for name, label, case in cases(not args.no_model_shapes, args.sweep):
        if only is not None and name not in only:
            continue
        for target in args.target.split(","):
            key = build_key(name, case, target)
            if key not in seen:
                seen.add(key)
                jobs.append((name, label, case, target))
    t0 = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for row in pool.map(check_one, jobs):  # one line a build, so a run cut short says how far it got
            rows.append(row)
            print(f"[{len(rows)}/{len(jobs)}] {row['spec']} {row['label']} {row['target']}: "
                  f"{row['seconds']:.1f} s{' (' + row['error'] + ')' if 'error' in row else ''}",
                  file=sys.stderr, flush=True)
    listed = details(rows) or "Every access proven or indexed by data."
    text = (f"{len(jobs)} builds lowered and checked in {time.perf_counter() - t0:.0f} s "
            f"({args.jobs} processes)\n\n{table(rows)}\n\n{listed}\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if any(r["unproven"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
