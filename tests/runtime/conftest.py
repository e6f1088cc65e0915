"""Shared fixtures: the tiny checkpoints are written once per session and loaded through the real reader."""

from __future__ import annotations

import functools

import pytest
import torch

from duotile.runtime.presets import get_preset
from duotile.runtime.reference import Model
from duotile.runtime.weights import Checkpoint, write_random_checkpoint

_DIRS: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _single_thread():
    """The tiny models are latency-bound; on a shared 2-core machine OpenMP threads only add barrier waits.

    Results do not depend on this (every comparison runs under the same setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    def get(name: str) -> str:
        if name not in _DIRS:
            _DIRS[name] = str(write_random_checkpoint(get_preset(name), tmp_path_factory.mktemp(name), seed=1234))
        return _DIRS[name]

    return get


@pytest.fixture(scope="session")
def build(ckpt_dir):
    """build(name, **Model kwargs) -> a cached reference model of a tiny preset."""

    @functools.cache
    def make(name: str, dtype=torch.bfloat16, quant: bool = True, batch_invariant: bool = False) -> Model:
        return Model(Checkpoint.open(ckpt_dir(name)), dtype=dtype, quant=quant, batch_invariant=batch_invariant)

    return make


def tokens(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
