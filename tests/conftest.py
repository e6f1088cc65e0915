"""Shared test setup: a fresh artifact cache per test session, so builds in tests really compile."""

from __future__ import annotations

import gc
import os

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


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
