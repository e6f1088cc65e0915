"""The config a call gets when it names none: chosen, never defaulted blindly.

In order:

1. the user's tuning cache (``duotile tune``), for this exact shape, else the entry of its shape
   bucket tuned at the nearest shape;
2. the shipped tuned table (``duotile/tuned/tuning.json``): the entry of the same kernel, dtypes,
   constants and target whose shape bucket is nearest (``bucket_distance``: octaves summed
   over the sizes) within ``MAX_OCTAVES``, within a bucket the one tuned at the nearest exact
   shape (``cache.shape_distance``). The table is keyed by the GPU it was measured on, but a
   target's code is the same on every GPU of the target: this GPU's entries come first, and
   where it has none in reach another GPU's entries of the same target serve it (an H100 takes
   the H200's sm90 entries), as they serve a machine without a GPU (an sm90 build made on a
   CPU is the build an H200 user gets, so it is a cache hit there);
3. the shipped starting table (``duotile/tuned/starting.json``): per-target configs chosen by
   hand to fit a target's memories, or from an earlier measurement, each with its reason;
4. the target's choice (``target_choice``): candidates around the kernel's defaults and the
   target's start points, kept if the target's capacity model and lowering accept them, and
   ranked by the cost model of ``passes/autotune/cost_model.py``; on a target we measure
   (sm90) only the kernel's tile sizes move, the schedule knobs stay at the target's defaults;
   the defaults where no candidate passes.

``explain_choice`` says which step answered, for reports and ``duotile build``.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..dsl.kernel import KernelDef, Signature

MAX_OCTAVES = 3  # a table entry serves a shape at most this many doublings away (summed over sizes)
MAX_CANDIDATES = 48  # the target's choice starts from the best of at most this many configs
CHOICE_BATCH = 1  # the batch a batch-invariant kernel's config is chosen at (one sequence)
SEARCH_PASSES = 3  # rounds of the coordinate search over the tunables
TIE = 0.02  # modelled times this close are a tie, broken toward the defaults


def choose_config(kernel: KernelDef, target: str, sig: Signature,
                  constants: dict | None = None) -> dict[str, Any] | None:
    config, _, skipped = explain_choice(kernel, target, sig, constants)
    for msg in skipped:
        warnings.warn(msg, stacklevel=2)
    return config


def explain_choice(kernel: KernelDef, target: str, sig: Signature,
                   constants: dict | None = None) -> tuple[dict[str, Any] | None, str, list[str]]:
    """(config or None for the defaults, where it came from: "tuned", "table", "starting", "model"
    or "default", one line per cached entry skipped because today's code refuses it)."""
    from ..passes.autotune.cache import lookup

    sig = at_choice_batch(kernel, sig)
    user, skipped = lookup(kernel, target, sig.shapes, dtypes=sig.dtypes, present=sig.present, constants=constants,
                           shipped=None)
    if user is not None:
        return user, "tuned", skipped
    near = nearest_shipped(kernel, target, sig, constants, skipped=skipped)
    if near is not None:
        return near, "table", skipped
    start = starting_config(kernel, target, sig, constants, skipped=skipped)
    if start is not None:
        return start, "starting", skipped
    chosen = target_choice(kernel, target, sig, constants)
    return (chosen, "model", skipped) if chosen is not None else (None, "default", skipped)


def at_choice_batch(kernel: KernelDef, sig: Signature) -> Signature:
    """The call with a dynamic batch size set to ``CHOICE_BATCH``: a batch-invariant kernel has one
    config for every batch (one build serves them all), so which batch came first must not choose
    it. The cost model ranks configs at one sequence: there a decode kernel has the least
    parallelism of its own and needs its splits most, while at a larger batch the same splits
    cost one more combine over more blocks."""
    dim = kernel.batch_dim
    if dim is None or dim not in sig.dynamic or dim in sig.bucketed or dim not in sig.shapes:
        return sig
    return replace(sig, shapes={**sig.shapes, dim: CHOICE_BATCH})


def bucket_distance(a: dict[str, int], b: dict[str, int]) -> float:
    """Octaves between two shape buckets, summed over their sizes (inf if they name other sizes)."""
    if set(a) != set(b):
        return math.inf
    return sum(abs(math.log2(a[k]) - math.log2(b[k])) for k in a)


def entry_distance(entry: dict, want: dict) -> tuple[float, float]:
    """How far a table entry is from a call's key ``want``: octaves between their buckets, then
    between the exact static shapes (the entry tuned nearest within a bucket)."""
    from ..passes.autotune import cache as tcache

    key = entry.get("key", {})
    return (bucket_distance(key.get("bucket", {}), want["bucket"]),
            tcache.shape_distance(tcache.entry_shape(entry), want["shape"]))


def nearest_shipped(kernel: KernelDef, target: str, sig: Signature, constants: dict | None = None,
                    path=None, skipped: list[str] | None = None,
                    max_octaves: float = MAX_OCTAVES) -> dict[str, Any] | None:
    """The shipped entry nearest to this call's bucket within ``max_octaves`` (within a bucket, the
    one tuned at the nearest exact shape; then the larger bucket), or None; an entry today's code
    refuses is noted in ``skipped`` and the next nearest is tried."""
    from ..passes.autotune import cache as tcache

    table = tcache.TuningCache(path or tcache.SHIPPED, read_only=True)
    if not table.entries:
        return None
    want = tcache.make_key(kernel, target, sig.shapes, dtypes=sig.dtypes, present=sig.present, constants=constants)
    ranked = []
    for entry in table.entries.values():
        key = entry.get("key", {})
        same = all(key.get(f) == want[f] for f in ("kernel", "kernel_hash", "dtypes", "constants", "target",
                                                    "toolchain"))
        d, near = entry_distance(entry, want) if same else (math.inf, math.inf)
        if d <= max_octaves:  # this GPU's entries first; within a bucket, the one tuned at the nearest shape
            other = key.get("device") != want["device"] and not want["device"].startswith("model:")
            ranked.append((other, d, near, -sum(key["bucket"].values()), len(ranked), entry))
    for *_, entry in sorted(ranked, key=lambda r: r[:5]):
        why = tcache.entry_problem(kernel, target, sig.shapes, entry.get("config"), sig.dtypes, sig.present, constants)
        if why is None:
            return dict(entry["config"])
        if skipped is not None:
            skipped.append(f"shipped config for {kernel.name} on {target} (bucket {entry['key']['bucket']}) "
                           f"skipped: {why}")
    return None


def starting_config(kernel: KernelDef, target: str, sig: Signature, constants: dict | None = None,
                    path=None, skipped: list[str] | None = None) -> dict[str, Any] | None:
    """The first entry of the shipped starting table (``duotile/tuned/starting.json``) for this
    kernel and target whose ``when`` matches the call: sizes by name, ``dtypes`` by tensor,
    ``present`` by optional tensor (given or not: another build), and constants by name."""
    from ..dsl.errors import DslError
    from .compile import check_config
    from .target import get_target

    consts = kernel.resolve_constants(constants)
    for entry in load_starting(path):
        if entry.get("kernel") != kernel.name or entry.get("target") != target:
            continue
        when = dict(entry.get("when", {}))
        dtypes, present = when.pop("dtypes", {}), when.pop("present", {})
        if any(sig.shapes.get(k, consts.get(k, _MISSING)) != v for k, v in when.items()):
            continue
        if any(bool(sig.present.get(t, False)) != bool(v) for t, v in present.items()):
            continue
        if any(getattr(sig.dtypes.get(t), "name", None) != d for t, d in dtypes.items()):
            continue
        # names and values are checked; capacity is not: an entry is the config meant for these
        # sizes, and where it does not fit, its build's refusal names the memory (not a fallback's)
        try:
            check_config(kernel, get_target(target), entry["config"])
        except DslError as err:
            if skipped is not None:
                skipped.append(f"starting config for {kernel.name} on {target} skipped: {err}")
            continue
        return dict(entry["config"])
    return None


_MISSING = object()
STARTING = Path(__file__).resolve().parents[1] / "tuned" / "starting.json"


def load_starting(path=None) -> list[dict]:
    """The starting table's entries; a damaged file is reported once and ignored."""
    path = Path(path or STARTING)
    try:
        data = json.loads(path.read_text())
        entries = data["entries"]
        if not isinstance(entries, list):
            raise TypeError("entries is not a list")
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("config"), dict)]
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"starting table {path} ignored: {err}", stacklevel=3)
        return []


_CHOICES: dict[tuple, tuple[KernelDef, dict[str, Any] | None]] = {}  # target_choice's answers, by call
_CHOICES_MAX = 4096


def target_choice(kernel: KernelDef, target: str, sig: Signature,
                  constants: dict | None = None) -> dict[str, Any] | None:
    """The cost model's best config that the target accepts, or None for the defaults, ranked over
    ``choice_signatures``: a function of the call's build (kernel, target, dtypes, present
    tensors, static sizes, constants), never of which call of that build came first. A pure
    function, so each answer is kept for the process: a model's shapes repeat across the targets,
    the sizes of a dynamic dimension and the phases of a generation (``_choose``)."""
    sigs = choice_signatures(kernel, sig, constants)
    key = (id(kernel), target, sig.key(), tuple(tuple(sorted(s.shapes.items())) for s in sigs),
           tuple(sorted((k, repr(v)) for k, v in (constants or {}).items())))
    hit = _CHOICES.get(key)
    if hit is None or hit[0] is not kernel:  # the kernel is kept beside its answer: an id is not reused
        if len(_CHOICES) >= _CHOICES_MAX:
            _CHOICES.clear()
        hit = _CHOICES[key] = (kernel, _choose(kernel, target, sigs, constants))
    return dict(hit[1]) if hit[1] is not None else None


def choice_signatures(kernel: KernelDef, sig: Signature, constants: dict | None = None) -> list[Signature]:
    """The calls a build's config is ranked over. One build serves every value of its dynamic sizes,
    and its config is chosen once, at its first call: ranked at that call's sizes alone, the config
    would depend on which call came first (V4's prefill meeting a CSA layer's 640-slot lists or an
    HCA layer's 8,320 first). So where the kernel's spec declares model shapes that share the
    call's build, they are the calls (each at ``CHOICE_BATCH``, repeats once); otherwise the call
    itself at ``CHOICE_BATCH``."""
    own = at_choice_batch(kernel, sig)
    if not any(d != kernel.batch_dim and d in sig.shapes for d in sig.dynamic):
        return [own]  # the batch alone is dynamic: ``at_choice_batch`` fixed it already
    resolved = tuple(sorted((k, repr(v)) for k, v in kernel.resolve_constants(constants).items()))
    same = [s for s, c in _model_signatures(kernel) if c == resolved and s.key() == sig.key()]
    unique = {tuple(sorted(s.shapes.items())): s for s in (at_choice_batch(kernel, s) for s in same)}
    return list(unique.values()) or [own]


_MODEL_SIGS: dict[int, tuple[KernelDef, list]] = {}


def _model_signatures(kernel: KernelDef) -> list[tuple[Signature, tuple]]:
    """(signature, resolved constants) of each model shape of the registered spec whose kernel is
    ``kernel``; none for a kernel no spec registers. Kept for the process."""
    hit = _MODEL_SIGS.get(id(kernel))
    if hit is None or hit[0] is not kernel:
        from ..kernels_spec.registry import load_all

        spec = load_all().get(kernel.name)
        out = []
        if spec is not None and spec.kernel is kernel:
            for case in spec.model_shapes.values():
                consts = spec.constants_of(case)
                resolved = tuple(sorted((k, repr(v)) for k, v in kernel.resolve_constants(consts).items()))
                out.append((kernel.bind(spec.meta_inputs(case)), resolved))
        hit = _MODEL_SIGS[id(kernel)] = (kernel, out)
    return hit[1]


def _choose(kernel: KernelDef, target: str, sig: Signature | list[Signature],
            constants: dict | None) -> dict[str, Any] | None:
    """``target_choice``'s search: the first of ``ranked_configs``, or None where that is the default."""
    sigs = [sig] if isinstance(sig, Signature) else list(sig)
    ranked = ranked_configs(kernel, target, sigs, constants)
    if not ranked:
        return None
    from ..passes.autotune.space import config_key

    return None if config_key(ranked[0]) == config_key(_space(kernel, target, sigs[0], constants)[1].default()) \
        else ranked[0]


_SPACES: dict[tuple, tuple] = {}  # _space's answers, by kernel, target, dtypes, present tensors and constants
_SPACES_MAX = 1024


def _space(kernel: KernelDef, target: str, sig: Signature, constants: dict | None):
    """(the traced module if it is one launch else None, the kernel's config space on the target,
    the target's start points for that module). None depends on the sizes (a trace is symbolic),
    so each is kept for the process and every shape of a kernel shares it; none is changed by
    its readers."""
    key = (id(kernel), target, tuple(sorted((k, v.name) for k, v in sig.dtypes.items())),
           tuple(sorted(sig.present.items())), tuple(sorted((k, repr(v)) for k, v in (constants or {}).items())))
    hit = _SPACES.get(key)
    if hit is None or hit[0] is not kernel:  # the kernel is kept beside its answer: an id is not reused
        if len(_SPACES) >= _SPACES_MAX:
            _SPACES.clear()
        hit = _SPACES[key] = (kernel, *_make_space(kernel, target, sig, constants))
    return hit[1:]


def _make_space(kernel: KernelDef, target: str, sig: Signature, constants: dict | None):
    from ..passes.autotune.space import ConfigSpace
    from .target import get_target

    tgt = get_target(target)
    traced = kernel.trace(sig.dtypes, sig.present, None, constants)
    one = traced if len(traced.body.ops) == 1 else None  # the knob filter reads a single launch
    return one, ConfigSpace.from_kernel(kernel, tgt, module=one), (tgt.start_points(one) if one is not None else [])


def ranked_configs(kernel: KernelDef, target: str, sig: Signature | list[Signature], constants: dict | None = None,
                   knobs: dict[str, Any] | None = None, count: int = 1) -> list[dict[str, Any]]:
    """Up to ``count`` configs the target accepts, best first by the cost model, found by a
    coordinate search; empty for a target the model does not know (the interpreter). With
    ``knobs``, every config has those target knobs (a schedule chosen by measurement) and the
    search moves the kernel's tunables alone. Over several calls of one build (a list of
    signatures, ``choice_signatures``) a config must pass at each, and its score is the sum of its
    modelled times: the time of those calls made once each, where the largest weigh most (a
    decode step's time goes to its long lists, not its short ones).

    Start: the best of the defaults, the target's start points and their neighbours. Then, in
    turn for each tunable of the kernel, every value of its space with the others held, keeping
    an improvement; passes repeat until one changes nothing (at most ``SEARCH_PASSES``). A whole
    axis is tried, not a step: a decode GEMM of one row wants a K split of 8 where the default is
    1, a few steps away through configs that are each slower than the last."""
    from ..passes.autotune.constraints import Constraints
    from ..passes.autotune.cost_model import estimate_phases
    from ..passes.autotune.space import config_key
    from .target import get_target

    tgt = get_target(target)
    try:
        machine = tgt.machine
    except (AttributeError, KeyError, NotImplementedError):
        machine = None
    if machine is None:  # a target the cost model does not know (the interpreter): its defaults
        return []
    sigs = [sig] if isinstance(sig, Signature) else list(sig)
    _, space, starts = _space(kernel, target, sigs[0], constants)
    default = space.default()
    pool = [default]
    if knobs is None:
        for partial in starts:
            pool.append({**default, **partial})
        if tgt.modelled:  # knobs move too there, one step from each start (the search below walks tunables)
            for base in list(pool):
                pool.extend(space.neighbours(base))
    # every tunable at its least value (the smallest tiles): a start that fits where the defaults
    # overflow more than one size at once, which a search moving one tunable at a time cannot leave
    pool.append({**default, **{k: min(space.params[k].values()) for k in kernel.tunables
                               if k not in space.pinned and _numeric(space.params[k].values())}})
    if knobs is not None:  # the given schedule on every config (knobs this kernel lacks are not set)
        pool = [{**c, **{k: v for k, v in knobs.items() if k in c}} for c in pool]
    elif not tgt.modelled:  # a target we measure on: the model moves tile sizes only, never the
        # schedule knobs, whose combinations only measurements (the shipped table) may choose
        pool = [c for c in pool if all(c[k] == default[k] for k in c if k not in kernel.tunables)]
    cons = [Constraints(kernel, s, target, constants) for s in sigs]
    scores: dict[tuple, float] = {}

    def modelled(c: dict[str, Any], at: Constraints) -> float:  # the quick checks only: lowering is slow
        verdict = at.check(c, full=False)
        knobs = {n: v for n, v in c.items() if n not in kernel.tunables}
        return estimate_phases(verdict.phases, machine, knobs, verdict.usages).time_s if verdict.ok else math.inf

    def score(c: dict[str, Any]) -> float:
        k = config_key(c)
        if k not in scores:
            scores[k] = sum(modelled(c, at) for at in cons)
            seen[k] = c
        return scores[k]

    seen: dict[tuple, dict[str, Any]] = {}

    def away(c: dict[str, Any]) -> int:  # tunables that differ from the defaults
        return sum(c[n] != default[n] for n in kernel.tunables)

    def pick(cands) -> dict[str, Any]:
        """The fastest; among those the model cannot tell from it (within ``TIE``), the nearest
        to the defaults: a plateau of equal estimates says nothing, and the defaults are the
        configs measured at the shapes the kernel was tuned on."""
        cands = list(cands)
        fastest = min(score(c) for c in cands)
        return min((c for c in cands if score(c) <= fastest * (1 + TIE)), key=lambda c: (away(c), score(c)))

    best = pick([*pool[:MAX_CANDIDATES - 1], pool[-1]])  # may be refused: the search moves on from it
    for _ in range(SEARCH_PASSES):
        before = config_key(best)
        for name in kernel.tunables:
            if name in space.pinned:
                continue
            best = pick((best, *({**best, name: v} for v in space.params[name].values())))
        if config_key(best) == before:
            break
    # the chosen config first if the target's own lowering and capacity checks accept it (with the
    # target's fitted knobs where it has any and no schedule was given), then the others by the
    # same order
    ranked = sorted((k for k in scores if scores[k] < math.inf),
                    key=lambda k: (k != config_key(best), scores[k], away(seen[k])))
    out = _fitted(tgt, cons, best) if knobs is None and scores[config_key(best)] < math.inf else []
    for k in ranked:
        if len(out) >= count:
            break
        if all(at.check(seen[k]).ok for at in cons):
            out.append(seen[k])
    return out


def _fitted(tgt, cons: list, best: dict[str, Any]) -> list[dict[str, Any]]:
    """The first of the target's fitted knob values (``Target.fitted_knobs``, read from ``best``'s
    bound phases) that every call accepts, on ``best``; empty where the target has none or every
    one is refused (the ranked configs follow)."""
    verdict = cons[0].check(best, full=False)
    if not verdict.ok:
        return []
    others = (at.check(best, full=False) for at in cons[1:])  # checked only where _programs reads them
    for knobs in tgt.fitted_knobs(verdict.phases, _programs(cons, [verdict], others)):
        fitted = {**best, **{k: v for k, v in knobs.items() if k in best}}
        if fitted == best:
            return []  # the search chose it already (a modelled target moves knobs too)
        if all(at.check(fitted).ok for at in cons):
            return [fitted]
    return []


def _programs(cons: list, *verdicts) -> int | None:
    """The most programs a launch runs over the calls of ``cons`` (``verdicts``: each call's check
    of the config, in iterables read only here), where the build is specialised to its sizes
    (static, or a bucket of them); None where it serves every value of a dynamic size (a decode
    step's batch and a prefill chunk's tokens alike)."""
    if any(d not in at.sig.bucketed for at in cons for d in at.sig.dynamic):
        return None
    return max((math.prod(int(e) for e in phase.grid.attrs["extents"])
                for verdict in itertools.chain(*verdicts) for phase in verdict.phases), default=0)


def _numeric(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)
