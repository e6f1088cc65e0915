"""The embedded model's directory under concurrent first use, after an interrupted writer, and when stale."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from duotile.runtime.loader import MARKER, _build, preset_dir, preset_problem
from duotile.runtime.weights import Checkpoint

PRESET = "v4-tiny"
WORKER = """
import sys
from duotile.runtime.loader import open_model
ckpt = open_model(sys.argv[1])
ckpt.get("head.weight")
print("ok", ckpt.path)
"""


def _half_written(root):
    """What an interrupted writer of an older version left: some files, no marker."""
    target = root / "models" / PRESET
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 64)
    return target


def test_four_concurrent_first_users_over_a_half_written_directory(tmp_path):
    target = _half_written(tmp_path)
    env = {**os.environ, "DUOTILE_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, PRESET], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=120) for p in procs]
    elapsed = time.perf_counter() - start
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert out.strip() == f"ok {target}"
    assert elapsed < 60, elapsed
    assert preset_problem(target, PRESET, deep=True) is None
    leftovers = [d.name for d in target.parent.iterdir() if d.name.startswith(f".{PRESET}-")]
    assert leftovers == []
    Checkpoint.open(target)


def test_a_directory_without_its_marker_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    target = _half_written(tmp_path)
    assert "no valid" in preset_problem(target, PRESET)
    assert preset_dir(PRESET) == target and preset_problem(target, PRESET, deep=True) is None


def test_a_truncated_or_stale_preset_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    target = preset_dir(PRESET)
    shard = target / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert "wrong size" in preset_problem(target, PRESET)
    preset_dir(PRESET)
    assert preset_problem(target, PRESET, deep=True) is None
    marker = json.loads((target / MARKER).read_text())
    marker["config"] = "0" * 64  # written by another version of the preset
    (target / MARKER).write_text(json.dumps(marker))
    assert "different version" in preset_problem(target, PRESET)
    preset_dir(PRESET)
    assert preset_problem(target, PRESET) is None


def test_a_rename_that_loses_to_a_concurrent_winner_keeps_the_winner(tmp_path, monkeypatch):
    """Without the lock (another tool, another host on a shared cache) two builders can both rename;
    the loser finds a valid directory in place and leaves it."""
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    target = preset_dir(PRESET)
    winner = {f.name: f.stat().st_mtime_ns for f in target.iterdir()}
    _build(target, PRESET)  # its rename fails: the directory exists and is complete
    assert {f.name: f.stat().st_mtime_ns for f in target.iterdir()} == winner
    assert [d.name for d in target.parent.iterdir() if d.name.startswith(f".{PRESET}-")] == []
