"""The shared build layer: generate and compile a specialised module, cached on disk.

An artifact lives in ``<cache>/artifacts/<kernel>/<target>/<key>/`` with one file per stage and
``meta.json``. The key hashes the lowered Tile IR text (which holds the shapes, dtypes, config
and constants), the target's knobs, the toolchain versions and duotile's own compiler sources
(the DSL, the passes and the generators), so a change to any of them builds anew. A directory
whose ``meta.json`` is missing or unreadable is rebuilt, never trusted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..dsl.ir import Module
from ..dsl.kernel import KernelDef
from ..dsl.printer import canonical_text
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
    key = artifact_key(module, target, knobs)
    final = Path(workdir) if workdir else cache_root() / "artifacts" / module.name / target.name / key
    if use_cache:
        cached = _read(final)
        if cached is not None:
            cached.meta["cache"] = "hit"
            return cached
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
    try:
        t0 = time.perf_counter()
        artifact = target.generate(module, knobs)
        artifact.timings["generate"] = time.perf_counter() - t0
        artifact.meta.update(key=key, kernel_hash=kernel.source_hash, knobs=knobs,
                             toolchain=target.toolchain(), shapes=module.shapes, config=module.config)
        artifact = target.build(artifact, str(tmp))
        _write(tmp, artifact)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    artifact.files = {k: str(final / Path(v).name) for k, v in artifact.files.items()}
    artifact.meta["cache"] = "miss"
    artifact.meta["dir"] = str(final)
    return artifact


def _write(d: Path, a: Artifact) -> None:
    for stage, text in a.stages.items():
        (d / STAGE_FILES.get(stage, f"{stage}.txt")).write_text(text)
    for path in a.files.values():
        if Path(path).parent != d:
            shutil.copy(path, d / Path(path).name)
    meta = {"kernel": a.kernel, "target": a.target, "stages": sorted(a.stages),
            "files": {k: Path(v).name for k, v in a.files.items()}, "timings": a.timings, "meta": a.meta}
    (d / "meta.json").write_text(json.dumps(meta, indent=1, default=str))


def _read(d: Path) -> Artifact | None:
    try:
        meta = json.loads((d / "meta.json").read_text())
        stages = {s: (d / STAGE_FILES.get(s, f"{s}.txt")).read_text() for s in meta["stages"]}
        files = {k: str(d / v) for k, v in meta["files"].items()}
        if not all(Path(f).exists() for f in files.values()):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    meta["meta"]["dir"] = str(d)
    return Artifact(meta["kernel"], meta["target"], stages, files, meta["timings"], meta["meta"])
