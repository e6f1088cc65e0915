"""Resolve `LLM(model)`: a checkpoint directory, or a tiny preset materialised once in a cache directory.

A tiny preset (`v4-tiny`, `v41-tiny`) is written by the random-checkpoint writer into
`$DUOTILE_CACHE/models/<preset>` (default `~/.cache/duotile/models/<preset>`) the first time it is
asked for - atomically, through a temporary directory - and then always loaded through the same
validating reader as any other checkpoint. The released presets have no embedded weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .config import ConfigError
from .presets import PRESETS, TINY_PRESETS, get_preset
from .weights import Checkpoint, write_random_checkpoint

PRESET_SEED = 0


def cache_root() -> Path:
    root = os.environ.get("DUOTILE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "duotile"


def preset_dir(name: str) -> Path:
    """The directory of a tiny preset's checkpoint, written on first use."""
    target = cache_root() / "models" / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write_random_checkpoint(get_preset(name), tmp, seed=PRESET_SEED)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def open_model(model: str | os.PathLike) -> Checkpoint:
    path = Path(model)
    if path.is_dir():
        return Checkpoint.open(path)
    name = str(model)
    if name in TINY_PRESETS:
        return Checkpoint.open(preset_dir(name))
    if name in PRESETS:
        raise ConfigError(f"model: preset {name!r} is a released model without embedded weights; "
                          f"pass its checkpoint directory")
    raise ConfigError(f"model: {name!r} is neither a checkpoint directory nor a preset {sorted(PRESETS)}")
