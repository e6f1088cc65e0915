"""Resolve `LLM(model)`: a checkpoint directory, or a tiny preset materialised once in a cache directory.

A tiny preset (`v4-tiny`, `v41-tiny`) is written by the random-checkpoint writer into
`$DUOTILE_CACHE/models/<preset>` (default `~/.cache/duotile/models/<preset>`) the first time it is
asked for, and then always loaded through the same validating reader as any other checkpoint.

Publishing is safe against concurrent first users and interrupted writers: the checkpoint is written
into a temporary directory beside the target, a marker (`.duotile-complete.json`: the preset, the
config digest, every file's size and SHA-256) is written into it last, and the directory is renamed
into place atomically. A target without a valid marker, or whose files do not match it, is a
half-written or stale directory: it is moved aside and rebuilt. Builders serialise on a lock file, so
one process writes while the others wait and then use its result; a rename that loses to a
concurrent winner keeps the winner's directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from .config import ConfigError
from .presets import PRESETS, get_preset, written_preset
from .weights import Checkpoint, CheckpointError, write_random_checkpoint

try:
    import fcntl
except ImportError:  # not POSIX: builders do not serialise, the rename still keeps one winner
    fcntl = None

PRESET_SEED = 0
MARKER = ".duotile-complete.json"
STALE_TMP_SECONDS = 600


def cache_root() -> Path:
    root = os.environ.get("DUOTILE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "duotile"


def _config_digest(name: str) -> str:
    text = json.dumps(get_preset(name).to_dict(), sort_keys=True)
    return hashlib.sha256(f"{text}:{PRESET_SEED}".encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_marker(path: Path, name: str) -> None:
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in sorted(path.iterdir())
             if f.is_file() and f.name != MARKER}
    marker = {"preset": name, "config": _config_digest(name), "files": files}
    (path / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))


def preset_problem(path: Path, name: str, deep: bool = False) -> str | None:
    """Why `path` is not a complete copy of preset `name` (None when it is). Sizes are always compared;
    `deep` also compares every file's SHA-256 (what `duotile check-model` does)."""
    if not path.is_dir():
        return "missing"
    try:
        marker = json.loads((path / MARKER).read_text())
        files = marker["files"]
        if marker.get("preset") != name or not isinstance(files, dict):
            return f"{MARKER} is not for preset {name}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"no valid {MARKER} (half-written by an interrupted or concurrent writer)"
    if marker.get("config") != _config_digest(name):
        return "written for a different version of the preset"
    for fname, want in files.items():
        f = path / fname
        if not f.is_file() or f.stat().st_size != want.get("bytes"):
            return f"{fname} is missing or has the wrong size"
        if deep and _sha256(f) != want.get("sha256"):
            return f"{fname} does not match its SHA-256 (modified or corrupt)"
    return None


def _discard(path: Path) -> None:
    """Move a broken directory aside atomically, then delete it."""
    trash = path.parent / f".{path.name}-broken-{uuid.uuid4().hex}"
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _sweep(parent: Path, name: str) -> None:
    """Temporary directories of writers that died (older than STALE_TMP_SECONDS)."""
    now = time.time()
    for d in parent.glob(f".{name}-*"):
        try:
            if d.is_dir() and now - d.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _build(target: Path, name: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-tmp-", dir=target.parent))
    try:
        write_random_checkpoint(get_preset(name), tmp, seed=PRESET_SEED)
        _write_marker(tmp, name)  # last: a directory with a valid marker is complete
        for _ in range(3):
            try:
                os.rename(tmp, target)
                return
            except OSError:  # the target exists: a concurrent winner, or a broken directory
                if preset_problem(target, name) is None:
                    return
                _discard(target)
        raise CheckpointError(f"{target}: cannot publish the {name} checkpoint (the directory keeps reappearing)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def preset_dir(name: str) -> Path:
    """The directory of a written preset's checkpoint (a tiny model, a released one on N layers),
    written (or repaired) on first use."""
    target = cache_root() / "models" / name
    if preset_problem(target, name) is None:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f".{name}.lock").open("a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; released when the file closes
        if preset_problem(target, name) is None:  # a concurrent builder finished while we waited
            return target
        _sweep(target.parent, name)
        if target.exists():
            _discard(target)
        _build(target, name)
    return target


def open_model(model: str | os.PathLike) -> Checkpoint:
    path = Path(model)
    if path.is_dir():
        return Checkpoint.open(path)
    name = str(model)
    if written_preset(name):
        return Checkpoint.open(preset_dir(name))
    if name in PRESETS:
        raise ConfigError(f"model: preset {name!r} is a released model without embedded weights; "
                          f"pass its checkpoint directory")
    raise ConfigError(f"model: {name!r} is neither a checkpoint directory nor a preset {sorted(PRESETS)}")
