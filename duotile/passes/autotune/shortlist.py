"""A short list of configs worth measuring at one shape, known before anything is measured.

A search (``strategies.py``) decides its next candidates from the last measurements, so its
builds cannot be made ahead. A model's sweep over dozens of shapes is dominated by those builds
(seconds each on sm90), so ``duotile tune --model ... --budget shortlist`` measures a list fixed up
front instead, which ``model_sweep`` builds for every shape at once in worker processes:

1. the config a user gets today with none given (``choose_config``): what a shipped entry must beat;
2. the kernel's defaults (a sweep's speed-up is against them);
3. the nearest measured entry of the shipped table for this kernel, target and dtypes at any
   distance and with any constants (a schedule that won on this GPU, e.g. at 8192^3, or causal
   attention's from the non-causal sweep), the cost model's best tiles at this shape under that entry's target knobs
   (``ranked_configs``), and from those the model's best other value of each tunable in turn,
   the best few of them: one config moves the tile's width, another its depth, another the K
   split, so the list spans what the model can rank least well (wave quantisation, pipelining)
   rather than one axis;
4. the same tiles under the schedule of the user's config, where room is left (all of it where
   the target refuses the measured schedule at this shape);
5. where the model's best tiles leave SMs idle (fewer programs than the machine has units: a
   router's N of 256 at 128 x 128 tiles is 64 programs on 132 SMs), its best configs within two
   tunables of them that fill the machine (``wave_filling``). The model's per-step latency term
   makes a wide tile and a narrow one tie there, and it keeps the one nearer the defaults;
6. for a kernel without a gemm whose tunables span at most ``WHOLE`` configs (a norm's rows a
   block and tile alignment), every one of them, times each value of the target's knobs in the
   order the target declares them while the product stays within ``WHOLE`` (on sm90, the threads
   a block, or as many of its leading values as fit); the list grows to hold them and two more of
   the above. A space that small costs less to measure whole than to rank, and the model ranks
   memory-bound tiles least well (a gemm's tiles it ranks well, and they build slowly).

Every config on the list but those of (6) is one the target's checks accept. Those of (6) are, like
a tune's start points, measured whatever the cost model's register estimate says (a 20,480-wide
norm row at 128 threads, which the estimate counts at 352 registers a thread, builds without
spilling and was the fastest measured); the build refuses what truly overflows.
"""

from __future__ import annotations

import math
from typing import Any

from ...codegen.choose_config import entry_distance, explain_choice, ranked_configs
from .constraints import Constraints
from .space import ConfigSpace, config_key

MODEL_PICKS = 3  # runners-up along the tunables' axes, under the measured schedule
WHOLE = 36  # a space this small is measured whole
WAVE_PICKS = 2  # configs that fill the machine, where the model's best leaves units idle
FILL = 0.9  # programs over units that count as filling the machine (128 tiles on 132 SMs do)


def shortlist(spec, case: dict, target: str, size: int = 8) -> list[dict[str, Any]]:
    """At most ``size`` full configs (tunables and target knobs) for ``case`` on ``target``."""
    from ...codegen.target import get_target

    kernel = spec.kernel
    sig = kernel.bind(spec.meta_inputs(case))
    constants = spec.constants_of(case)
    traced = kernel.trace(sig.dtypes, sig.present, None, constants)
    one = traced if len(traced.body.ops) == 1 else None
    space = ConfigSpace.from_kernel(kernel, get_target(target), module=one).starting_at(spec.config_of(case, target))
    default = space.default()
    chosen, _, _ = explain_choice(kernel, target, sig, constants)
    out = [{**default, **(chosen or {})}, default]
    entry = nearest_measured(kernel, target, sig)
    schedules = []  # target knobs the model's tiles are ranked under: a measured one first
    if entry is not None:
        out.append({**default, **entry})
        schedules.append({k: v for k, v in entry.items() if k not in kernel.tunables})
    schedules.append({k: v for k, v in out[0].items() if k not in kernel.tunables})  # the user's today
    for knobs in schedules:
        best = ranked_configs(kernel, target, sig, constants, knobs=knobs)
        if best:  # none where the target refuses these knobs at this shape (a pair of blocks, say)
            out += [best[0], *wave_filling(kernel, target, sig, constants, space, best[0], WAVE_PICKS),
                    *axis_runners_up(kernel, target, sig, constants, space, best[0], MODEL_PICKS)]
    gemm = any(op.name == "gemm" for op in traced.walk())
    whole = [] if gemm else whole_space(space, out[0])
    cons = Constraints(kernel, sig, target, constants)
    kept, seen = list(whole), {config_key(c) for c in whole}
    for c in out:
        key = config_key(c)
        if key not in seen and cons.check(c).ok:
            seen.add(key)
            kept.append(c)
    return kept[:max(size, len(whole) + 2)]  # (6) whole, and two of (1)-(5) it does not hold


def whole_space(space: ConfigSpace, schedule: dict[str, Any]) -> list[dict[str, Any]]:
    """Every value of the free tunables, where they span at most ``WHOLE`` configs (else none),
    times the values of the free target knobs in declaration order while the product stays within
    ``WHOLE`` (of the knob that would pass it, its leading values that fit, if two do: sm90's 256,
    128 and 512 threads for 12 tunable configs, all five thread counts for 4); the other knobs as
    in ``schedule``. The user's config (``schedule``) comes first."""
    import itertools

    free = space.free
    values = {n: space.params[n].values() for n in free if space.owners.get(n) == "kernel"}
    if not values or math.prod(map(len, values.values())) > WHOLE:
        return []
    for knob in (n for n in free if space.owners.get(n) == "target"):
        fit = WHOLE // math.prod(map(len, values.values()))
        if fit < 2:
            break
        values[knob] = space.params[knob].values()[:fit]  # its leading values (the default first)
        if fit < len(space.params[knob].values()):
            break
    combos = itertools.product(*values.values())
    out = [{**schedule, **dict(zip(values, combo))} for combo in combos]
    return sorted(out, key=lambda c: c != schedule)


def nearest_measured(kernel, target: str, sig, path=None) -> dict[str, Any] | None:
    """The config of the shipped table's measured entry nearest to this call's bucket among those of
    the same kernel, target, dtypes and toolchain, whatever their constants (None if there is none).
    It is a candidate to measure, not a config to use: ``shortlist`` keeps it only where the
    target's checks accept it here."""
    from . import cache as tcache

    table = tcache.TuningCache(path or tcache.SHIPPED, read_only=True)
    want = tcache.make_key(kernel, target, sig.shapes, dtypes=sig.dtypes, present=sig.present)
    near = []
    for i, entry in enumerate(table.entries.values()):
        key = entry.get("key", {})
        if entry.get("metric") != "measured" or not isinstance(entry.get("config"), dict):
            continue
        if all(key.get(f) == want[f] for f in ("kernel", "target", "dtypes", "toolchain")):
            near.append((*entry_distance(entry, want), i, entry["config"]))
    return dict(min(near, key=lambda n: n[:3])[3]) if near else None


def axis_runners_up(kernel, target: str, sig, constants, space: ConfigSpace, best: dict[str, Any],
                    n: int) -> list[dict[str, Any]]:
    """For each tunable, ``best`` with that tunable at the value the cost model ranks next; the
    ``n`` of them the model ranks fastest (configs it would not accept are left out)."""
    model = _Model(kernel, target, sig, constants)

    def modelled(c):
        est, _ = model(c)
        return est.time_s if est is not None else math.inf

    runners = []
    for name in kernel.tunables:
        if name in space.pinned:
            continue
        others = [{**best, name: v} for v in space.params[name].values() if v != best[name]]
        scored = sorted(((modelled(c), i, c) for i, c in enumerate(others)), key=lambda x: x[:2])
        if scored and scored[0][0] < math.inf:
            runners.append(scored[0])
    return [c for _, _, c in sorted(runners, key=lambda x: x[:2])[:n]]


def wave_filling(kernel, target: str, sig, constants, space: ConfigSpace, best: dict[str, Any],
                 n: int) -> list[dict[str, Any]]:
    """Where ``best`` runs fewer programs than ``FILL`` of the machine's units, up to ``n`` configs
    that change one or two of ``best``'s tunables and run at least that many programs:
    the cost model's fastest of those that keep ``best``'s launches (a narrower tile), then its
    fastest of any (a K split, whose second launch adds its partial sums); none where ``best``
    fills the machine already. The model ranks these two ways to fill the SMs least well."""
    import itertools

    estimated = _Model(kernel, target, sig, constants)
    units = estimated.machine.units
    first, launches = estimated(best)
    if first is None or first.programs >= FILL * units:
        return []
    names = [k for k in kernel.tunables if k not in space.pinned]
    moves = {k: [v for v in space.params[k].values() if v != best[k]] for k in names}
    same, other = [], []
    for pair in itertools.chain(((k,) for k in names), itertools.combinations(names, 2)):
        for values in itertools.product(*(moves[k] for k in pair)):
            c = {**best, **dict(zip(pair, values))}
            est, phases = estimated(c)
            if est is not None and est.programs >= FILL * units:
                (same if phases == launches else other).append((est.time_s, len(same) + len(other), c))
    picks = [min(group, key=lambda x: x[:2]) for group in (same, same + other) if group]
    out = []
    for *_, c in picks:
        if c not in out:
            out.append(c)
    return out[:n]


class _Model:
    """The cost model's estimate of a config at one call (and its launches), or (None, 0) where
    the quick checks refuse it."""

    def __init__(self, kernel, target: str, sig, constants):
        from ...codegen.target import get_target

        self.kernel, self.machine = kernel, get_target(target).machine
        self.cons = Constraints(kernel, sig, target, constants)

    def __call__(self, config: dict[str, Any]):
        from .cost_model import estimate_phases

        v = self.cons.check(config, full=False)
        if not v.ok:
            return None, 0
        knobs = {k: x for k, x in config.items() if k not in self.kernel.tunables}
        return estimate_phases(v.phases, self.machine, knobs), len(v.phases)
