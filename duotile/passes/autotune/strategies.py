"""Search strategies, generic over any ``ConfigSpace``: they only call ``default``, ``sample``,
``neighbours``, ``enumerate`` and ``size``, never a parameter's name.

    trials = search(space, evaluate, budget="quick", feasible=constraints_ok)

``evaluate`` takes a batch of configs (compiled in parallel by the runner) and returns one cost
per config (lower is better; ``None`` for a candidate that failed, was wrong or timed out).
``feasible`` prunes a config before it is evaluated; pruned configs do not use the budget.

Strategies follow an ask / tell protocol:
- ``exhaustive``: every config in order (small spaces);
- ``random``: distinct random samples;
- ``pattern``: start at the default, move to the best neighbour while one improves, then try
  two-step neighbours, then restart from random samples (helion's PatternSearch, without its surrogate).
``auto`` picks ``exhaustive`` when the space fits the budget, otherwise ``pattern``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from .space import Config, ConfigSpace, config_key


@dataclass(frozen=True)
class Budget:
    name: str
    max_candidates: int  # configs evaluated (pruned ones are free)
    max_seconds: float
    batch: int  # configs compiled together


BUDGETS = {
    # no search: the default and the configs given as start points (``shortlist.py``), which a
    # model's sweep builds for every shape at once before measuring any
    "shortlist": Budget("shortlist", 0, 10 * 60, 8),
    "quick": Budget("quick", 24, 8 * 60, 8),
    "default": Budget("default", 80, 30 * 60, 16),
    "full": Budget("full", 400, 3 * 3600, 32),
}


def get_budget(budget: str | Budget) -> Budget:
    if isinstance(budget, Budget):
        return budget
    try:
        return BUDGETS[budget]
    except KeyError:
        raise KeyError(f"unknown budget {budget!r}; known: {', '.join(BUDGETS)}") from None


class Strategy:
    name = ""

    def __init__(self, space: ConfigSpace, rng: random.Random):
        self.space, self.rng = space, rng
        self.seen: dict[tuple, float | None] = {}
        self.best: tuple[float, Config] | None = None

    def ask(self, n: int) -> list[Config]:
        """Up to ``n`` configs not seen before; an empty list means the strategy is done."""
        raise NotImplementedError

    def tell(self, config: Config, cost: float | None) -> None:
        self.seen[config_key(config)] = cost
        if cost is not None and math.isfinite(cost) and (self.best is None or cost < self.best[0]):
            self.best = (cost, dict(config))

    def _new(self, config: Config, batch: list[Config]) -> bool:
        k = config_key(config)
        return k not in self.seen and all(config_key(c) != k for c in batch)


class Exhaustive(Strategy):
    name = "exhaustive"

    def __init__(self, space, rng):
        super().__init__(space, rng)
        self._it = space.enumerate()

    def ask(self, n):
        out = []
        for c in self._it:
            if self._new(c, out):
                out.append(c)
            if len(out) == n:
                break
        return out


class RandomSearch(Strategy):
    name = "random"

    def ask(self, n):
        out = []
        if not self.seen:
            out.append(self.space.default())
        tries = 0
        while len(out) < n and tries < 50 * n and len(self.seen) + len(out) < self.space.size:
            c = self.space.sample(self.rng)
            tries += 1
            if self._new(c, out):
                out.append(c)
        return out


class PatternSearch(Strategy):
    """Hill-climb over one-step neighbours of the best seen; at a local optimum try two-step
    neighbours, then restart from random points."""

    name = "pattern"

    def __init__(self, space, rng, initial_random: int = 3):
        super().__init__(space, rng)
        self.initial_random, self.started = initial_random, False

    def ask(self, n):
        out: list[Config] = []
        if not self.started:  # the default (unless told already) and a few random points
            self.started = True
            if self._new(self.space.default(), out):
                out.append(self.space.default())
            tries = 0  # configs told before (start points) may leave fewer unseen than asked for
            while (len(out) < min(n, 1 + self.initial_random) and len(self.seen) + len(out) < self.space.size
                   and tries < 50 * n):
                c = self.space.sample(self.rng)
                tries += 1
                if self._new(c, out):
                    out.append(c)
            if out:
                return out
        centres = [self.best[1]] if self.best else []
        for centre in centres:
            for c in self.space.neighbours(centre):
                if len(out) < n and self._new(c, out):
                    out.append(c)
        if not out and self.best:  # a local optimum: look two steps away (crosses plateaus)
            for near in self.space.neighbours(self.best[1]):
                for c in self.space.neighbours(near):
                    if len(out) < n and self._new(c, out):
                        out.append(c)
        if not out:  # still nothing new (or nothing valid yet): restart from unseen random points
            tries = 0
            while len(out) < max(1, n // 2) and tries < 50 * n and len(self.seen) + len(out) < self.space.size:
                c = self.space.sample(self.rng)
                tries += 1
                if self._new(c, out):
                    out.append(c)
        return out


STRATEGIES = {"exhaustive": Exhaustive, "random": RandomSearch, "pattern": PatternSearch}


def make_strategy(name: str, space: ConfigSpace, budget: Budget, seed: int = 0) -> Strategy:
    if name == "auto":
        name = "exhaustive" if space.size <= budget.max_candidates else "pattern"
    try:
        return STRATEGIES[name](space, random.Random(seed))
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: auto, {', '.join(STRATEGIES)}") from None


@dataclass
class Step:
    config: Config
    cost: float | None
    pruned: bool = False


def search(space: ConfigSpace, evaluate: Callable[[list[Config]], list[float | None]],
           budget: str | Budget = "default", strategy: str = "auto", seed: int = 0,
           feasible: Callable[[Config], bool] | None = None, clock=time.monotonic,
           known: list[tuple[Config, float | None]] = ()) -> list[Step]:
    """Run ``strategy`` until the budget (candidates or seconds) is spent or it has nothing new.
    ``known``: configs already evaluated (the default, start points), told to the strategy first."""
    budget = get_budget(budget)
    strat = make_strategy(strategy, space, budget, seed)
    for config, cost in known:
        strat.tell(config, cost)
    steps: list[Step] = []
    evaluated, start = 0, clock()
    max_pruned = max(10_000, 50 * budget.max_candidates)
    while evaluated < budget.max_candidates and clock() - start < budget.max_seconds:
        asked = strat.ask(min(budget.batch, budget.max_candidates - evaluated))
        if not asked:
            break
        batch = []
        for c in asked:
            if feasible is not None and not feasible(c):
                strat.tell(c, None)
                steps.append(Step(c, None, pruned=True))
            else:
                batch.append(c)
        if sum(s.pruned for s in steps) > max_pruned:
            break
        if not batch:
            continue
        for c, cost in zip(batch, evaluate(batch)):
            strat.tell(c, cost)
            steps.append(Step(c, cost))
        evaluated += len(batch)
    return steps
