"""One tuning sweep, end to end: space -> constraints -> search -> runner (or cost model) -> cache.

    result = tune(spec, case, "sm90", budget="quick", pins={"STAGES": 3})

On a runnable target every candidate is compiled, verified against the spec's reference and
timed. On sm100 / ascend950 (no hardware here) feasible configs are ranked by the cost model
and compiled best-first; only those that compile are kept, and the result says
``metric = "model"``.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...codegen.target import get_target
from ...dsl.errors import DslError
from ...dsl.tunables import ConfigValueError
from ...kernels_spec.registry import Spec
from ..check_batch_invariance import check_batch_invariance
from . import cache as tcache
from .constraints import Constraints
from .cost_model import estimate_phases
from .runner import DeviceStuck, Runner, Trial
from .space import Config, ConfigSpace, config_key, parse_value
from .strategies import get_budget, search


@dataclass
class TuneResult:
    kernel: str
    target: str
    case: dict
    shapes: dict[str, int]
    metric: str  # "measured" | "model"
    trials: list[Trial]
    default: Trial | None
    best: Trial | None
    space_size: int
    budget: str
    strategy: str
    wall_s: float
    device: str = ""
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False  # stopped by Ctrl-C: the results are those measured before
    saved: str | None = None  # the tuning cache the best config was written to, if any

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.status] = out.get(t.status, 0) + 1
        return out

    @property
    def speedup(self) -> float | None:
        if self.best and self.default and self.default.counts and self.best.final_ms:
            return self.default.final_ms / self.best.final_ms
        return None


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="cfg", leave=True)
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None


def tune(spec: Spec, case: dict, target: str, *, budget: str = "default", strategy: str = "auto",
         pins: dict[str, Any] | None = None, device: str | None = None, seed: int = 0,
         relations: list[str] = (), cache_dir: str | None = None, write_cache: bool = True,
         progress: bool = True, runner_options: dict | None = None,
         on_trial: Callable[[Trial], None] | None = None, finalists: int = 3, rounds: int = 3,
         also_try: list[dict[str, Any]] = (), start_points: bool = True) -> TuneResult:
    """``finalists`` of the fastest measured candidates (and the default) are re-timed side by
    side, ``rounds`` times, before the best is chosen (``confirm``); 0 skips that. ``also_try``:
    partial configs (over the default) measured right after it, after the target's own
    ``start_points`` (unless ``start_points`` is false: a shortlist holds its own); the search
    starts from the best."""
    t_start = time.monotonic()
    kernel = spec.kernel
    bud = get_budget(budget)
    tgt = get_target(target)
    notes: list[str] = []
    if write_cache:  # an unwritable cache fails now, not after the sweep it was to keep
        tcache.TuningCache(tcache.cache_path(cache_dir)).check_writable()
    model = tgt.modelled
    runner = Runner(spec, case, target, device=device, seed=seed, measure=not model, **(runner_options or {}))
    sig = runner.sig
    # traces the kernel; a batch-invariant one whose reduction order could change with the batch
    # size fails here, once, before any candidate compiles (every build checks it again, in specialize)
    traced = check_batch_invariance(kernel, sig.dtypes, sig.present, runner.constants)
    # the knob filter reads a single launch, as the config choice's space does (choose_config._space)
    one = traced if len(traced.body.ops) == 1 else None
    space = ConfigSpace.from_kernel(kernel, tgt, pins, module=one).starting_at(spec.config_of(case, target))
    if kernel.batch_dim:
        notes.append(f"batch-invariant in {kernel.batch_dim}: reductions checked; the cached config "
                     f"serves every {kernel.batch_dim}")
    own = tgt.start_points(traced) if start_points else []
    starts = [start_point(space, partial) for partial in [*own, *also_try]]
    cons = Constraints(kernel, sig, target, runner.constants, relations, space.owners)
    trials: list[Trial] = []
    bar = _progress(bud.max_candidates, f"tune {kernel.name} {target}") if progress else None
    default_key = config_key(space.default())

    def record(t: Trial):
        t.index = len(trials)
        t.is_default = config_key(t.config) == default_key
        trials.append(t)
        if bar is not None and t.status != "pruned":
            bar.update(1)
            best = min((x.time_ms for x in trials if x.counts), default=None)
            bar.set_postfix_str(f"best {best:.4g} ms" if best else t.status)
        if on_trial:
            on_trial(t)

    def feasible(c: Config) -> bool:
        v = cons.check(c)
        if not v.ok:
            record(Trial(c, "pruned", "; ".join(v.reasons), usage=v.usage))
        return v.ok

    def start_feasible(c: Config) -> bool:
        """The default and the start points were chosen by someone: they are measured unless a
        build would refuse them; the quick estimates only filter what the search proposes."""
        v = cons.check(c)
        if v.ok:
            return True
        if cons.law(c):
            record(Trial(c, "pruned", "; ".join(v.reasons), usage=v.usage))
            return False
        notes.append(f"measured {' '.join(f'{k}={x}' for k, x in c.items())} although the quick estimate "
                     f"would prune it ({v.reasons[0]}): a start point")
        return True

    interrupted = False
    if model:
        notes.append(f"ranking by the analytical cost model of {tgt.machine.name}: a model, not a "
                     f"measurement ({tgt.machine.assumed})")
        strategy_used = "model-ranked"
    else:
        strategy_used = strategy if strategy != "auto" else (
            "exhaustive" if space.size <= bud.max_candidates else "pattern")
    try:
        if model:
            _model_sweep(space, cons, runner, bud, seed, feasible, record)
        else:
            _measured_sweep(space, cons, runner, bud, strategy, seed, feasible, record, starts, start_feasible)
    except KeyboardInterrupt:  # keep what was measured: it is saved and reported like a finished sweep
        interrupted = True
        notes.append(f"sweep interrupted after {sum(t.status != 'pruned' for t in trials)} candidates; "
                     "the results are those measured before")
    finally:
        if bar is not None:
            bar.close()

    good = [t for t in trials if t.counts]
    dflt = next((t for t in trials if t.is_default), None)
    if runner.stuck:
        notes.append(f"sweep stopped: {runner.stuck}; the results are those measured before")
    elif not model and not interrupted and finalists and len(good) > 1:
        try:
            notes.append(confirm(runner, good, dflt, finalists, rounds))
            good = [t for t in good if t.confirmed_ms is not None]  # the best is a finalist
        except TimeoutError as err:  # a finalist hung on its re-timing: keep the sweep's own times
            notes.append(f"confirm phase stopped ({err}); the best is chosen by the sweep's times")
        except KeyboardInterrupt:
            interrupted = True
            for t in good:
                t.confirmed_ms = None
            notes.append("confirm phase interrupted; the best is chosen by the sweep's times")
    best = _pick(good, model, notes)
    dev = tcache.device_name(target)
    result = TuneResult(kernel.name, target, dict(case), dict(sig.shapes), "model" if model else "measured",
                        trials, dflt, best, space.size, bud.name, strategy_used, time.monotonic() - t_start,
                        dev, notes, interrupted)
    if best is not None and write_cache:
        try:
            result.saved = str(_remember(result, runner, cache_dir))
        except OSError as err:  # the results stay in the report; one line says why they are not cached
            notes.append(f"best config not saved to the tuning cache: {type(err).__name__}: {err}")
    return result


def _pick(good: list[Trial], model: bool, notes: list[str]) -> Trial | None:
    """The fastest candidate; under a cost model, which does not see register spills, one that
    ptxas says spills only wins when nothing else compiled."""
    if not good:
        return None
    fastest = min(good, key=lambda t: t.final_ms)
    if not model:
        return fastest  # a measurement has already paid for any spill
    best = min(good, key=lambda t: (bool(t.build.get("spill_stores")), t.final_ms))
    if best is not fastest:
        notes.append(f"the model's fastest candidate spills registers ({fastest.build.get('spill_stores')} bytes, "
                     "ptxas); the pick is the fastest that does not")
    return best


def _measured_sweep(space, cons, runner, bud, strategy, seed, feasible, record, starts,
                    start_feasible) -> None:
    """Compile, verify and time the default and the start points (``start_feasible`` decides which
    can be built), then what the search strategy asks for, starting from the best of them."""
    default = space.default()
    done: dict[tuple, float | None] = {}

    def evaluate(batch: list[Config]) -> list[float | None]:
        if runner.stuck:
            raise DeviceStuck(runner.stuck)
        out = []
        for t in runner.evaluate(batch):
            t.usage = cons.check(t.config).usage
            record(t)
            done[config_key(t.config)] = t.time_ms if t.counts else None
            out.append(done[config_key(t.config)])
        return out

    first, seen = [], set()  # the default is always measured: the speed-up is against it
    for c in [default, *starts]:
        if config_key(c) not in seen and start_feasible(c):
            first.append(c)
        seen.add(config_key(c))
    if first:
        evaluate(first)
    try:
        search(space, evaluate, bud, strategy, seed, feasible=lambda c: config_key(c) not in done and feasible(c),
               known=[(c, done[config_key(c)]) for c in first])
    except DeviceStuck:  # a candidate hung the GPU: report what was measured (tune() notes why)
        pass


def start_point(space: ConfigSpace, partial: dict[str, Any]) -> Config:
    """The default with ``partial``'s values: every name a parameter of the space and every value
    one of its choices, or a ValueError that says which is not."""
    out = space.default()
    for name, value in partial.items():
        if name not in space.params:
            raise ConfigValueError(f"also_try: {name!r} is not a tunable or knob here; known: "
                                   f"{', '.join(space.params)}")
        dom = space.params[name]
        try:
            out[name] = parse_value(dom, value) if isinstance(value, str) and not dom.accepts(value) else value
        except DslError:
            out[name] = value
        if not dom.accepts(out[name]):
            raise ConfigValueError(f"also_try: {name}={value!r} is not {dom.allowed()}")
    return out


def _remember(result: TuneResult, runner: Runner, cache_dir: str | None):
    """Write the best config to the tuning cache under this call's key (merged into the file under
    its lock: sweeps running at once keep each other's entries); the cache's path."""
    sig, kernel, tgt = runner.sig, runner.spec.kernel, runner.target
    key = tcache.make_key(kernel, result.target, sig.shapes, result.device, tgt.toolchain(), sig.dtypes,
                          sig.present, runner.constants)
    cache = tcache.TuningCache(tcache.cache_path(cache_dir))
    result.notes.extend(cache.problems)
    dflt = result.default
    cache.put(key, result.best.config, time_ms=result.best.final_ms, metric=result.metric,
              default_time_ms=dflt.final_ms if dflt and dflt.counts else None, shapes=sig.shapes,
              case=dict(result.case), **({"interrupted": True} if result.interrupted else {}))
    return cache.path


def confirm(runner: Runner, good: list[Trial], default: Trial | None, finalists: int, rounds: int) -> str:
    """Re-time the fastest ``finalists`` (and the default) in alternating rounds and record each
    one's median as ``confirmed_ms``: single timings taken minutes apart drift with the GPU's
    clocks and temperature, enough to reorder configs a few percent apart."""
    chosen = sorted(good, key=lambda t: t.time_ms)[:finalists]
    if default is not None and default.counts and default not in chosen:
        chosen.append(default)
    times = runner.retime([t.config for t in chosen], rounds)
    for trial, ts in zip(chosen, times):
        trial.confirmed_ms = statistics.median(ts)
    return (f"best chosen after re-timing {len(chosen)} finalists side by side, {rounds} rounds "
            f"(confirmed_ms in the report)")


def _model_sweep(space, cons, runner, bud, seed, feasible, record):
    """Rank feasible configs by the cost model, then compile best-first; keep those that compile."""
    if space.size <= 4096:
        pool = list(space.enumerate())
    else:
        rng = random.Random(seed)
        seen, pool = set(), [space.default()]
        for _ in range(4096):
            c = space.sample(rng)
            if config_key(c) not in seen:
                seen.add(config_key(c))
                pool.append(c)
    ranked = []
    default_key = config_key(space.default())
    for c in pool:
        if feasible(c):
            v = cons.check(c)
            knobs = {k: x for k, x in c.items() if space.owners.get(k) == "target"}
            ranked.append((estimate_phases(v.phases, runner.target.machine, knobs).time_ms, c))
    ranked.sort(key=lambda x: (x[0], config_key(x[1]) != default_key))
    # the default is compiled too (speed-up is reported against it), then the best-ranked
    order = [x for x in ranked if config_key(x[1]) == default_key] + \
            [x for x in ranked if config_key(x[1]) != default_key][: bud.max_candidates]
    for i in range(0, len(order), bud.batch):
        chunk = order[i:i + bud.batch]
        for (ms, _), t in zip(chunk, runner.evaluate([c for _, c in chunk])):
            t.metric = "model"
            t.usage = cons.check(t.config).usage
            if t.status == "compiled":
                t.time_ms = ms
            record(t)
