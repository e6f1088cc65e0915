"""Shared test setup: a fresh artifact cache per test session, so builds in tests really compile."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

# The cyclic collector's thresholds for a test process: the traces, bound modules and config
# choices that codegen keeps per process (passes/autotune/constraints.py, codegen/choose_config.py)
# grow the heap to millions of tracked objects, and at the default thresholds (700, 10, 10) full
# collections rescanning all of them came to a quarter of a generation test's time. Only when
# cyclic garbage is freed changes (no test relies on that: none uses weakrefs or finalizers).
GC_THRESHOLDS = (50_000, 20, 20)


def pytest_configure(config):
    gc.set_threshold(*GC_THRESHOLDS)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """One artifact cache for the test session, shared by its xdist workers (the store publishes
    an entry atomically, so workers building one artifact at once end on one verified entry): a
    kernel two workers' tests build compiles once. Tests of the cache itself use their own."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / "duotile-cache"
    path.mkdir(exist_ok=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("DUOTILE_CACHE", str(path))
    yield
    mp.undo()


@pytest.hookimpl(trylast=True)  # after -m has deselected: the order is of the tests that run
def pytest_collection_modifyitems(config, items):
    import torch

    items[:] = longest_first(items, _durations())
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


DURATIONS = Path(__file__).with_name("durations.json")  # seconds by test id, the tests of a second or more


def _durations() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def longest_first(items: list, seconds: dict[str, float], halves: int = 2) -> list:
    """The tests in an order that balances xdist's work stealing: it hands each worker a
    contiguous run of the collection (the first half, the second half) and an idle worker steals
    from the end of another's run, so each half holds about half of the known seconds, longest
    first, and the quick tests (not in ``seconds``) fill both halves to equal counts, last. The
    tests of a module, class or package fixture stay together in their order (one set-up each);
    everything else keeps its collection order among equals."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit(item), []).append(item)
    timed = sorted((u for u in units.values() if _seconds(u, seconds) > 0), key=lambda u: -_seconds(u, seconds))
    quick = [item for u in units.values() if _seconds(u, seconds) == 0 for item in u]
    parts: list[list] = [[] for _ in range(halves)]
    load = [0.0] * halves
    for u in timed:  # each to the half with the fewest seconds so far
        i = min(range(halves), key=lambda h: (load[h], len(parts[h])))
        parts[i] += u
        load[i] += _seconds(u, seconds)
    for item in quick:  # each to the half with the fewest tests so far
        min(parts, key=len).append(item)
    return [item for part in parts for item in part]


def _seconds(unit: list, seconds: dict[str, float]) -> float:
    return sum(seconds.get(item.nodeid, 0.0) for item in unit)


def _unit(item) -> str:
    """The tests that must run together: a module's (class's) tests where one of its fixtures is
    module- (class-, package-) scoped, else the test alone."""
    info = getattr(item, "_fixtureinfo", None)
    scopes = {defs[-1].scope for defs in (info.name2fixturedefs.values() if info else ()) if defs}
    if scopes & {"module", "class", "package"}:
        return item.nodeid.split("::")[0]
    return item.nodeid
