"""Shared test setup: a private artifact cache per session, so builds in tests really compile."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("DUOTILE_CACHE", str(tmp_path_factory.mktemp("duotile-cache")))
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
