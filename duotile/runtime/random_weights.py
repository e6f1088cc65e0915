"""Random weights drawn on a device and held in memory: a checkpoint for benchmarks at real widths.

A released model on a few layers (`layer_subset.py`) has tens of GB of weights; writing a random
checkpoint of them to disk and reading it back (`weights.write_random_checkpoint`) takes minutes of
a CPU. `RandomCheckpoint(cfg, seed, device)` reads like a `Checkpoint` (`config`, `specs`, `get`,
`packed`), so `Model` and `WeightSource` take it as they take a checkpoint directory, but draws each
tensor where it is asked for, on `device`: the same value laws (`weights._draw`), encoded to the same
stored formats (FP8 / FP4 codes and UE8M0 scales, `weights.stored_tensors`), from a generator on the
device seeded by (seed, name). Nothing is kept: asking twice draws the same value twice. The values
are not those a CPU writer draws for the same seed (another generator); they need no value scan
(drawn here, never read from a file).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .config import ModelConfig
from .footprint import check_tensor_count
from .inventory import TensorSpec
from .weights import Checkpoint, _draw, stored_tensors


class RandomCheckpoint(Checkpoint):
    """A random checkpoint for ``cfg`` drawn on ``device`` (module docstring)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu"):
        check_tensor_count(cfg)
        super().__init__(Path(f"<random weights, seed {seed}, on {device}>"), cfg, {})
        self.seed, self.device = seed, torch.device(device)

    def _generator(self, name: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))

    def _stored(self, spec: TensorSpec) -> dict[str, torch.Tensor]:
        value = _draw(self.config, spec, self._generator(spec.name), spec.shape)
        return dict(stored_tensors(self.config, spec, value))

    def _scan(self, parts: dict[str, torch.Tensor]) -> list:
        return []  # drawn and encoded here: no file's codes to check

    def raw(self, name: str) -> torch.Tensor:
        logical = name.removesuffix(".weight").removesuffix(".scale")
        for spec in (self.specs.get(name), self.specs.get(logical)):
            if spec is not None and name in spec.stored(self.config.weight_block_size[0]):
                return self._stored(spec)[name]
        raise KeyError(f"{name}: not a stored tensor of this checkpoint")

    def findings(self) -> list:
        return []
