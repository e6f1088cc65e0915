"""``duotile tune KERNEL --model v41-flash|v4-flash``: tune a spec at every shape a model needs.

The model's shapes come from the spec (``Spec.model_cases``). Shapes that share a tuning key
(the same shape bucket: every size rounded up to a power of two, a decode kernel's batch and its
dynamic sizes left out) are tuned once, at the first of them. Each sweep runs under the given
budget (``quick``: minutes a shape) and records its best config in the tuning cache; with
``ship`` the cache is the table shipped with duotile (``duotile/tuned/tuning.json``), which
``choose_config`` reads for every user. One table closes the run.

``shapes`` picks some of the model's shapes by name (``fnmatch`` patterns: ``"*/prefill*"``).
With the ``shortlist`` budget each bucket measures a list fixed before any measurement
(``shortlist.py``), so every bucket's candidates are built first, in ``jobs`` worker processes
on this machine's cores, and the sweep then only loads, verifies and times them: a GPU's time
goes to measuring, not to waiting on one compile after another.
"""

from __future__ import annotations

import fnmatch
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from .cache import SHIPPED, shape_bucket


@dataclass
class ShapeRun:
    shape: str
    bucket: dict
    serves: list[str] = field(default_factory=list)  # the model shapes this sweep's entry serves
    result: object | None = None
    error: str = ""


def plan(spec, model: str, shapes: list[str] | None = None) -> list[ShapeRun]:
    """One run per distinct bucket of the model's shapes (those ``shapes`` matches, if given), in
    the spec's order, tuned at the largest shape it serves (a dynamic size's bucket is left out of
    the key: its config serves decode rows and prefill chunks alike, and the prefill time weighs
    most)."""
    runs: dict[tuple, ShapeRun] = {}
    volume: dict[tuple, int] = {}
    for name, case in spec.model_cases(model).items():
        if shapes and not any(fnmatch.fnmatchcase(name, pat) for pat in shapes):
            continue
        sig = spec.kernel.bind(spec.meta_inputs(case))
        bucket = shape_bucket(spec.kernel, sig.shapes)
        key = (tuple(sorted(bucket.items())), tuple(sorted((k, v.name) for k, v in sig.dtypes.items())),
               tuple(sorted(spec.constants_of(case).items())))
        size = 1
        for v in sig.shapes.values():
            size *= v
        run = runs.setdefault(key, ShapeRun(name, bucket))
        run.serves.append(name)
        if size > volume.get(key, 0):
            run.shape, volume[key] = name, size
    return list(runs.values())


def sweep(spec, model: str, target: str, budget: str = "quick", ship: bool = False, cache_dir: str | None = None,
          progress: bool = True, seed: int = 0, shapes: list[str] | None = None, jobs: int = 1) -> list[ShapeRun]:
    from .shortlist import shortlist
    from .tuner import tune

    runs = plan(spec, model, shapes)
    where = str(SHIPPED.parent) if ship else cache_dir
    cases = spec.model_cases(model)
    lists: dict[str, list[dict]] = {}
    if budget == "shortlist":
        lists = {r.shape: shortlist(spec, cases[r.shape], target) for r in runs}
        if jobs > 1:
            prebuild_configs(spec, [(cases[r.shape], c) for r in runs for c in lists[r.shape]], target, jobs)
    for i, run in enumerate(runs):
        print(f"[{i + 1}/{len(runs)}] {spec.name} {run.shape} (serves {len(run.serves)} shape(s))", flush=True)
        extra = {"also_try": lists[run.shape], "start_points": False} if budget == "shortlist" else {}
        try:
            run.result = tune(spec, cases[run.shape], target, budget=budget, cache_dir=where, progress=progress,
                              seed=seed, **extra)
        except KeyboardInterrupt:
            run.error = "interrupted"
            break
        except Exception as err:  # noqa: BLE001 - one shape's failure is reported, the sweep goes on
            run.error = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return runs


def prebuild_configs(spec, jobs_list: list[tuple[dict, dict]], target: str, jobs: int) -> list[str]:
    """Build each (case, config) of ``spec`` for ``target`` in ``jobs`` spawned processes, into the
    artifact cache and the target's loader cache (``Target.prepare_load``); one line each: ""
    where it built, else why not (the sweep then reports that candidate's failure itself)."""
    t0 = time.monotonic()
    names = [spec.name] * len(jobs_list)
    cases, configs = [c for c, _ in jobs_list], [k for _, k in jobs_list]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        out = list(pool.map(_build_config, names, cases, configs, [target] * len(jobs_list)))
    failed = sum(bool(o) for o in out)
    print(f"built {len(out) - failed} of {len(out)} candidates in {time.monotonic() - t0:.0f} s on {jobs} "
          f"processes" + (f" ({failed} failed: measured as failures)" if failed else ""), flush=True)
    return out


def _build_config(spec_name: str, case: dict, config: dict, target: str) -> str:
    """Worker-process entry of ``prebuild_configs``."""
    from ...codegen.compile import build_phases, specialize_phases
    from ...codegen.target import get_target
    from ...kernels_spec import registry

    try:
        spec = registry.get(spec_name)
        tgt = get_target(target)
        sig = spec.kernel.bind(spec.meta_inputs(case))
        phases, knobs = specialize_phases(spec.kernel, sig, tgt, config, spec.constants_of(case))
        for art in build_phases(spec.kernel, phases, tgt, knobs):
            tgt.prepare_load(art)
        return ""
    except Exception as err:  # noqa: BLE001 - reported in the count; the sweep measures it as a failure
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def table(runs: list[ShapeRun]) -> str:
    rows = [("shape", "serves", "best config", "best ms", "default ms", "speed-up")]
    for r in runs:
        res = r.result
        if res is None or res.best is None:
            rows.append((r.shape, str(len(r.serves)), r.error or "no candidate passed", "-", "-", "-"))
            continue
        cfg = ",".join(f"{k}={v}" for k, v in sorted(res.best.config.items()))
        default = res.default.final_ms if res.default and res.default.counts else None
        rows.append((r.shape, str(len(r.serves)), cfg, f"{res.best.final_ms:.4g}",
                     f"{default:.4g}" if default else "-", f"{res.speedup:.3f}x" if res.speedup else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

