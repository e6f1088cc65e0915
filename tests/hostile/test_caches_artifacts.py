"""The artifact cache under damaged entries, concurrent builders and killed builds."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from duotile.codegen import artifact_store as store
from duotile.codegen.build import build_module
from duotile.codegen.compile import specialize
from duotile.codegen.target import Artifact, Target, get_target
from duotile.kernels_spec import get


class BinaryTarget(Target):
    """A target shaped like sm90 and cheap: it writes the generated ``kernel_tilelang.py`` and a
    binary file, and counts its builds."""

    name = "fakecuda"
    stages = ("ir", "tilelang")
    builds = 0

    def generate(self, module, knobs):
        return Artifact(module.name, self.name, stages={"ir": "ir of " + module.name,
                                                        "tilelang": "KERNEL = 'generated'\n"})

    def build(self, artifact, workdir):
        type(self).builds += 1
        (Path(workdir) / "kernel_tilelang.py").write_text(artifact.stages["tilelang"])
        (Path(workdir) / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(range(200)))
        artifact.files["cubin"] = str(Path(workdir) / "kernel.cubin")
        return artifact


def _module(shape_t: int = 4):
    """rmsnorm's build for one shape; its token count is dynamic, so the shapes differ in width."""
    spec = get("rmsnorm")
    sig = spec.kernel.bind(spec.make_inputs({"T": 4, "D": 16 * shape_t}, torch.device("cpu"), 0))
    return spec.kernel, specialize(spec.kernel, sig, "interpret")


def _build(tmp_path, **kw):
    kernel, (module, knobs) = _module()
    return build_module(kernel, module, BinaryTarget(), knobs, workdir=str(tmp_path / "entry"), **kw)


@pytest.mark.parametrize("damage", ["empty cubin", "replaced cubin", "edited tilelang", "deleted tilelang"])
def test_a_damaged_file_is_rebuilt_never_loaded(tmp_path, damage):
    first = _build(tmp_path)
    assert first.meta["cache"] == "miss"
    entry = Path(first.meta["dir"])
    cubin, source = entry / "kernel.cubin", entry / "kernel_tilelang.py"
    good_cubin, good_source = cubin.read_bytes(), source.read_text()
    if damage == "empty cubin":
        cubin.write_bytes(b"")
    elif damage == "replaced cubin":
        cubin.write_bytes(b"\x7fELF" + bytes(200))  # same size, other bytes
    elif damage == "edited tilelang":
        source.write_text(good_source.replace("generated", "injected"))
    else:
        source.unlink()
    before = BinaryTarget.builds
    again = _build(tmp_path)
    assert again.meta["cache"] == "stale->rebuilt"
    assert again.meta["cache_problem"].split()[0] in ("kernel.cubin", "kernel_tilelang.py")
    assert BinaryTarget.builds == before + 1
    assert cubin.read_bytes() == good_cubin and source.read_text() == good_source
    assert again.stages["tilelang"] == good_source
    assert _build(tmp_path).meta["cache"] == "hit"


def test_a_meta_whose_digests_were_edited_to_match_is_not_trusted(tmp_path):
    first = _build(tmp_path)
    entry = Path(first.meta["dir"])
    (entry / "kernel_tilelang.py").write_text("KERNEL = 'injected'\n")
    meta = json.loads((entry / "meta.json").read_text())
    meta["digests"]["kernel_tilelang.py"] = store._sha256(entry / "kernel_tilelang.py")
    (entry / "meta.json").write_text(json.dumps(meta))
    again = _build(tmp_path)
    assert again.meta["cache"] == "stale->rebuilt" and "digest" in again.meta["cache_problem"]
    assert "injected" not in (entry / "kernel_tilelang.py").read_text()


def test_an_entry_without_digests_from_an_older_build_is_rebuilt(tmp_path):
    first = _build(tmp_path)
    meta_path = Path(first.meta["dir"]) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["digests"], meta["meta_digest"]
    meta_path.write_text(json.dumps(meta))
    assert _build(tmp_path).meta["cache"] == "stale->rebuilt"


def test_the_loser_of_a_publish_race_takes_the_winners_verified_entry(tmp_path):
    final = tmp_path / "entry"
    a, b = store.new_temp(tmp_path, "k"), store.new_temp(tmp_path, "k")
    for d, text in ((a, "first"), (b, "second")):
        (d / "x.txt").write_text(text)
        store.write_meta(d, {"who": text})
    assert store.publish(a, final) is True
    assert store.publish(b, final) is False  # 'Directory not empty' is the loser's cue, not an error
    assert (final / "x.txt").read_text() == "first" and b.exists()  # the caller publishes it again or removes it
    (final / "x.txt").write_text("edited")  # an unverified entry in the way is replaced
    c = store.new_temp(tmp_path, "k")
    (c / "x.txt").write_text("third")
    store.write_meta(c, {"who": "third"})
    assert store.publish(c, final) is True and store.read(final)[0]["who"] == "third"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(store.TRASH)]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_dirs_of_killed_builds_are_swept_at_the_next_build(tmp_path):
    parent = tmp_path / "artifacts"
    parent.mkdir()
    host = store.socket.gethostname()
    dead = parent / f"{store.TMP}{_dead_pid()}.0000.key@{host}"
    old_elsewhere = parent / f"{store.TMP}1.0000.key@another-host"
    young_elsewhere = parent / f"{store.TMP}1.1111.key@another-host"
    trash = parent / f"{store.TRASH}abcd"
    live = store.new_temp(parent, "key")  # this process: a build in progress
    for d in (dead, old_elsewhere, young_elsewhere, trash):
        d.mkdir()
        (d / "kernel.cubin").write_bytes(b"half")
    hours_ago = time.time() - 2 * 3600
    os.utime(old_elsewhere, (hours_ago, hours_ago))
    kernel, (module, knobs) = _module()
    build_module(kernel, module, BinaryTarget(), knobs, workdir=str(parent / "entry"))
    left = {p.name for p in parent.iterdir()}
    assert left == {young_elsewhere.name, live.name, "entry"}


def test_a_loser_whose_winner_is_moved_aside_before_it_reads_places_its_own(tmp_path, monkeypatch):
    # the order four concurrent builders once met: B loses the race to A's verified entry, then a
    # forced rebuild (use_cache=False) moves A's entry aside before B reads it
    first = _build(tmp_path)
    publish = store.publish

    def lose_then_vanish(tmp, final, replace=False):
        if final.exists():
            monkeypatch.setattr(store, "publish", publish)
            assert publish(tmp, final) is False
            store.discard(final)
            return False
        return publish(tmp, final, replace)

    monkeypatch.setattr(store, "publish", lose_then_vanish)
    second = _build(tmp_path, use_cache=False)
    assert second.meta["dir"] == first.meta["dir"] and store.read(Path(second.meta["dir"]))[0] is not None
    assert Path(second.files["cubin"]).read_bytes().startswith(b"\x7fELF")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- several processes building the same artifacts into one cache --------------------------------
def _builder(cache: str, shapes: list[int], barrier, delay: float, queue) -> None:
    os.environ["DUOTILE_CACHE"] = cache
    from duotile.codegen import artifact_store

    publish, lost = artifact_store.publish, []

    def slow_publish(tmp, final, replace=False):  # every builder has built before any renames
        time.sleep(delay)
        ours = publish(tmp, final, replace)
        lost.append(not ours)
        return ours

    artifact_store.publish = slow_publish
    target = get_target("interpret")
    out = []
    try:
        for i, t in enumerate(shapes):
            kernel, (module, knobs) = _module(t)
            barrier.wait(timeout=60)
            a = build_module(kernel, module, target, knobs, use_cache=i % 4 != 3)
            out.append((t, a.meta["dir"], a.meta["cache"], sorted(a.stages)))
        queue.put(("ok", out, sum(lost)))
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        queue.put(("error", f"{type(err).__name__}: {err}"))


def test_concurrent_builders_of_one_artifact_all_succeed_on_one_verified_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    workers, shapes = 4, list(range(1, 13))
    barrier, queue = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_builder, args=(str(tmp_path), shapes, barrier, 0.05, queue))
             for _ in range(workers)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r[1] for r in results if r[0] != "ok"]
    assert not errors, errors
    runs = [r[1] for r in results]
    assert sum(r[2] for r in results) > 0  # the race happened: some builder found the entry placed
    for i in range(len(shapes)):
        dirs = {run[i][1] for run in runs}
        assert len(dirs) == 1, dirs  # every builder ended on the same entry
        meta, why = store.read(Path(dirs.pop()))
        assert meta is not None, why
        assert all(run[i][3] == ["ir"] for run in runs)
    root = tmp_path / "artifacts" / "rmsnorm" / "interpret"
    assert len([p for p in root.iterdir() if not p.name.startswith(".")]) == len(shapes)
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no temp dir or trash left


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_sm90_cached_tilelang_source_edited_is_rebuilt(tmp_path):
    spec = get("rmsnorm")
    sig = spec.kernel.bind(spec.meta_inputs({"T": 4, "D": 256}))
    module, knobs = specialize(spec.kernel, sig, "sm90")
    target = get_target("sm90")
    first = build_module(spec.kernel, module, target, knobs, workdir=str(tmp_path / "sm90"))
    source = Path(first.meta["dir"]) / "kernel_tilelang.py"
    good = source.read_text()
    source.write_text(good + "\nraise SystemExit('edited in the cache')\n")
    again = build_module(spec.kernel, module, target, knobs, workdir=str(tmp_path / "sm90"))
    assert again.meta["cache"] == "stale->rebuilt" and source.read_text() == good
