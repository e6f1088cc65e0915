import random

from duotile import dsl
from duotile.passes.autotune.space import ConfigSpace
from duotile.passes.autotune.strategies import Budget, search


def make_space():
    return ConfigSpace({"a": dsl.pow2(1, 1024), "b": dsl.int_range(0, 20), "c": dsl.choice(3, 1, 2),
                        "d": dsl.boolean(), "e": dsl.enum("x", "y", "z")})


def cost(c):
    # a smooth bowl with its optimum at a=64, b=13, c=2, d=True, e="z"; unrelated to the defaults
    import math

    return ((math.log2(c["a"]) - 6) ** 2 + (c["b"] - 13) ** 2 + abs(c["c"] - 2) + (0 if c["d"] else 3)
            + {"x": 2, "y": 1, "z": 0}[c["e"]])


OPT = {"a": 64, "b": 13, "c": 2, "d": True, "e": "z"}


def run(strategy, budget, feasible=None, space=None):
    calls = []

    def evaluate(batch):
        calls.append(len(batch))
        return [cost(c) for c in batch]

    steps = search(space or make_space(), evaluate, budget, strategy, seed=3, feasible=feasible)
    scored = [s for s in steps if s.cost is not None]
    return min(scored, key=lambda s: s.cost), steps, calls


def test_pattern_search_finds_the_optimum():
    best, steps, _ = run("pattern", Budget("t", 300, 60, 8))
    assert best.config == OPT and best.cost == 0
    assert len([s for s in steps if not s.pruned]) <= 300


def test_exhaustive_finds_the_optimum_of_a_small_space():
    space = make_space().pin(a=64, b=13)
    best, steps, _ = run("auto", Budget("t", 100, 60, 4), space=space)
    assert best.config == OPT
    assert len(steps) == space.size == 18


def test_random_search_improves_on_the_default_and_respects_budget():
    best, steps, calls = run("random", Budget("t", 40, 60, 5))
    assert sum(calls) == 40 and max(calls) <= 5
    assert best.cost < cost(make_space().default())
    assert len({tuple(sorted(s.config.items())) for s in steps}) == len(steps)  # no repeats


def test_pruned_configs_do_not_use_the_budget_and_are_never_evaluated():
    seen = []

    def feasible(c):
        return c["b"] % 2 == 1  # only odd b

    def evaluate(batch):
        seen.extend(batch)
        return [cost(c) for c in batch]

    steps = search(make_space(), evaluate, Budget("t", 200, 60, 8), "pattern", seed=1, feasible=feasible)
    assert all(c["b"] % 2 == 1 for c in seen)
    assert any(s.pruned for s in steps)
    assert min(cost(c) for c in seen) == 0  # b=13 is odd: still found


def test_failed_candidates_are_skipped_by_the_search():
    def evaluate(batch):
        return [None if c["d"] else cost(c) for c in batch]  # every d=True candidate "fails"

    steps = search(make_space(), evaluate, Budget("t", 300, 60, 8), "pattern", seed=5)
    best = min((s for s in steps if s.cost is not None), key=lambda s: s.cost)
    assert best.config == {**OPT, "d": False}


def test_time_budget_stops_the_search():
    ticks = iter(range(0, 10_000, 7))
    steps = search(make_space(), lambda b: [cost(c) for c in b], Budget("t", 10_000, 20, 4), "random",
                   clock=lambda: next(ticks))
    assert 0 < len(steps) <= 3 * 4
    random.Random(0)


def test_pattern_search_climbs_from_a_known_start_point_and_never_re_evaluates_it():
    # a start point next to the optimum (what `duotile tune --also-try` gives): a handful of steps
    near = {**OPT, "b": 12}
    evaluated = []

    def evaluate(batch):
        evaluated.extend(batch)
        return [cost(c) for c in batch]

    steps = search(make_space(), evaluate, Budget("t", 12, 60, 4), "pattern", seed=3, known=[(near, cost(near))])
    assert near not in evaluated
    assert OPT in evaluated  # one step away from the start; a random start would need far more
    assert min(s.cost for s in steps if s.cost is not None) == 0


def test_pattern_search_ends_when_known_configs_leave_fewer_unseen_than_its_first_batch():
    # regression: told 3 of a 4-config space before its first ask, the random start looped forever
    space = ConfigSpace({"a": dsl.choice(1, 2, 3, 4)})
    known = [({"a": v}, float(v)) for v in (1, 2, 3)]
    steps = search(space, lambda batch: [float(c["a"]) for c in batch], Budget("t", 10, 60, 8), "pattern",
                   known=known)
    assert [s.config for s in steps] == [{"a": 4}]
