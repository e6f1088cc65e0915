"""Runs a generated kernel on a local GPU through TileLang's JIT (used on the H200)."""

from __future__ import annotations

from pathlib import Path

import torch

from ...dsl.errors import UnsupportedError
from ...dsl.ir import Module
from ..target import Artifact
from . import toolchain
from .arch import Arch
from .emit import present_params


def make_launcher(artifact: Artifact, module: Module, arch: Arch):
    if not torch.cuda.is_available():
        raise UnsupportedError(f"{arch.name}: no CUDA device here; the build is compile-only")
    cc = torch.cuda.get_device_capability()
    if cc != arch.runnable_cc:
        raise UnsupportedError(f"{arch.name} code needs compute capability {arch.runnable_cc}, this GPU has {cc}")
    jit = jit_compile(artifact, arch)
    present = present_params(module)
    used = [p.name for p in module.params if p.name in present]  # the prim_func's argument order

    call = _direct(jit)

    def run(tensors: dict):
        call(*(tensors[name] for name in used))

    run.jit = jit
    return run


def jit_compile(artifact: Artifact, arch: Arch):
    """TileLang's JIT kernel of the cached source: compiled by nvcc with its host wrapper, or read
    from TileLang's kernel cache (``$TILELANG_CACHE_DIR``; keyed by the source, target, pass
    configs, TileLang version and machine, not by the GPU). Needs no GPU: a CPU machine with nvcc
    can fill the cache for a GPU machine to read."""
    import tilelang
    from tilelang import tvm

    path = _verified_copy(artifact)
    prim, configs = toolchain.load_generated(str(path), artifact.meta["entry"])
    target = tvm.target.Target({"kind": "cuda", "arch": arch.sm})
    return tilelang.compile(prim, target=target, pass_configs=configs)


def _direct(jit):
    """The compiled function itself where TileLang allocates no outputs (every duotile kernel
    writes into tensors it is given): TileLang's Python wrapper around it rebuilds the argument
    list and looks up the device each call, host time a decode step's many small launches add
    up. Its own shape, dtype and device checks stay: they are in the compiled function."""
    adapter = getattr(jit, "adapter", None)
    executable = getattr(adapter, "_get_executable", None)
    if executable is None or getattr(adapter, "result_idx", None) or getattr(
            adapter, "_ffi_callee_allocated_output_abi", False):
        return jit
    return executable()


def _verified_copy(artifact: Artifact) -> Path:
    """The cached source, read once, checked against the digest its entry recorded, and loaded from
    a private copy: an edit to the cache directory after the check never runs."""
    import hashlib
    import tempfile

    cached = Path(artifact.meta["dir"]) / "kernel_tilelang.py"
    data = cached.read_bytes()
    want = (artifact.meta.get("digests") or {}).get("kernel_tilelang.py")
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise UnsupportedError(f"{cached}: does not match the digest its cache entry recorded (edited after the "
                               "build); rebuild it (duotile build --no-cache)")
    if data.decode() != artifact.stages.get("tilelang", data.decode()):
        raise UnsupportedError(f"{cached}: differs from the source this build generated; rebuild it")
    fd, tmp = tempfile.mkstemp(prefix="duotile_launch_", suffix=".py")
    with open(fd, "wb") as f:
        f.write(data)
    return Path(tmp)
