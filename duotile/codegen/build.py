"""The shared build layer: generate and compile a specialised module, cached on disk.

An artifact lives in ``<cache>/artifacts/<kernel>/<target>/<key>/`` with one file per stage and
``meta.json``. The key hashes the lowered Tile IR text (which holds the shapes, dtypes, config
and constants), the target's knobs, the toolchain versions and duotile's own compiler sources
(the DSL, the passes and the generators), so a change to any of them builds anew. A directory
whose ``meta.json`` is missing or unreadable, or whose files do not match the digests it
records, is rebuilt, never loaded (``artifact_store.py``: atomic writes, concurrent builders,
abandoned temporary directories).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from ..dsl.ir import Module
from ..dsl.kernel import KernelDef
from ..dsl.printer import canonical_text
from . import artifact_store as store
from .target import Artifact, Target

STAGE_FILES = {"ir": "kernel.ir", "tilelang": "kernel_tilelang.py", "cuda": "kernel.cu", "ptx": "kernel.ptx",
               "sass": "kernel.sass", "ascend": "kernel_ascend.cpp"}


def cache_root() -> Path:
    return Path(os.environ.get("DUOTILE_CACHE", Path.home() / ".cache" / "duotile"))


@functools.lru_cache(maxsize=1)
def compiler_digest() -> str:
    """A hash of the sources that turn a kernel into code: an edited generator never reuses the
    artifacts of the old one."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for sub in ("dsl", "passes", "codegen"):
        for f in sorted((root / sub).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def artifact_key(module: Module, target: Target, knobs: dict) -> str:
    text = canonical_text(module)
    blob = json.dumps({"ir": text, "target": target.name, "knobs": knobs, "toolchain": target.toolchain(),
                       "compiler": compiler_digest(), "format": 1}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def build_module(kernel: KernelDef, module: Module, target: Target, knobs: dict,
                 workdir: str | None = None, use_cache: bool = True) -> Artifact:
    """The artifact of ``module``: a verified cache entry (``meta["cache"]`` "hit"), else a new build
    ("miss", or "stale->rebuilt" with ``meta["cache_problem"]`` saying what did not match)."""
    key = artifact_key(module, target, knobs)
    final = Path(workdir) if workdir else cache_root() / "artifacts" / module.name / target.name / key
    store.sweep(final.parent)
    problem = "absent"
    if use_cache:
        cached, problem = _read(final)
        if cached is not None:
            cached.meta["cache"] = "hit"
            return cached
    tmp = store.new_temp(final.parent, key)
    try:
        t0 = time.perf_counter()
        artifact = target.generate(module, knobs)
        artifact.timings["generate"] = time.perf_counter() - t0
        artifact.meta.update(key=key, kernel_hash=kernel.source_hash, knobs=knobs,
                             toolchain=target.toolchain(), shapes=module.shapes, config=module.config)
        artifact = target.build(artifact, str(tmp))
        _write(tmp, artifact)
        ours = store.publish(tmp, final, replace=not use_cache)
        theirs = None if ours else _settle(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if theirs is not None:  # another process built it at the same time: its verified entry stands
        artifact = theirs
    artifact.files = {k: str(final / Path(v).name) for k, v in artifact.files.items()}
    if problem == "absent" or not use_cache:
        artifact.meta["cache"] = "miss"
    else:
        artifact.meta.update(cache="stale->rebuilt", cache_problem=problem)
    artifact.meta["dir"] = str(final)
    return artifact


def _settle(tmp: Path, final: Path, attempts: int = 8) -> Artifact | None:
    """After a lost publish race: the winner's entry when it still verifies, else ``None`` once
    ``tmp`` is placed instead (the winner's entry was moved aside by a forced rebuild, or damaged,
    between the race and this read)."""
    why = ""
    for _ in range(attempts):
        theirs, why = _read(final)
        if theirs is not None:
            return theirs
        if store.publish(tmp, final):
            return None
    raise OSError(f"the artifact other builds place at {final} never verified ({why})")


def _write(d: Path, a: Artifact) -> None:
    for stage, text in a.stages.items():
        (d / STAGE_FILES.get(stage, f"{stage}.txt")).write_text(text)
    for path in a.files.values():
        if Path(path).parent != d:
            shutil.copy(path, d / Path(path).name)
    meta = {"kernel": a.kernel, "target": a.target, "stages": sorted(a.stages),
            "files": {k: Path(v).name for k, v in a.files.items()}, "timings": a.timings, "meta": a.meta}
    store.write_meta(d, meta)  # last: digests of everything above


def _read(d: Path) -> tuple[Artifact | None, str]:
    """The entry in ``d`` when every file matches its digest, else ``(None, why)``."""
    meta, why = store.read(d)
    if meta is None:
        return None, why
    try:
        names = {STAGE_FILES.get(s, f"{s}.txt") for s in meta["stages"]} | set(meta["files"].values())
        unsealed = sorted(names - set(meta["digests"]))
        if unsealed:
            return None, f"{unsealed[0]} is not covered by the entry's digests"
        stages = {s: (d / STAGE_FILES.get(s, f"{s}.txt")).read_text() for s in meta["stages"]}
        files = {k: str(d / v) for k, v in meta["files"].items()}
        info = dict(meta["meta"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"meta.json malformed ({type(err).__name__}: {err})"
    info["dir"] = str(d)
    return Artifact(meta["kernel"], meta["target"], stages, files, meta["timings"], info), ""
