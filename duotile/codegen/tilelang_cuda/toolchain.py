"""TileLang and nvcc, driven offline: load generated source, lower it, compile it to a cubin."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

PASS_CONFIGS = {"tl.emit_line_directives": False}


@functools.lru_cache(maxsize=1)
def tilelang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tilelang")
    except PackageNotFoundError:
        return "missing"


@functools.lru_cache(maxsize=1)
def nvcc_version() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return "missing"
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1]


def load_generated(path: str, name: str) -> tuple[object, dict]:
    """Import a generated file (TileLang parses real source files): its prim_func, and the TileLang
    pass options it asks for (a module-level ``PASS_CONFIGS``) over ours."""
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    spec = importlib.util.spec_from_file_location(f"duotile_gen_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name), {**PASS_CONFIGS, **getattr(module, "PASS_CONFIGS", {})}


def lower_to_cuda(prim_func, sm: str, configs: dict | None = None) -> str:
    return lower_checked(prim_func, sm, configs)[0]


def lower_checked(prim_func, sm: str, configs: dict | None = None):
    """The CUDA source TileLang lowers ``prim_func`` to, and the bounds report of its global
    accesses as lowered (``lowered_bounds.py``; None where the lowering never reached the pass
    the check runs before)."""
    import tilelang
    from tilelang import tvm

    from .lowered_bounds import capture, check_module

    tgt = tvm.target.Target({"kind": "cuda", "arch": sm})
    seen = capture()
    with tilelang.transform.PassContext(opt_level=3, config=configs or PASS_CONFIGS, instruments=[seen]), tgt:
        artifact = tilelang.lower(prim_func, target=tgt, enable_device_compile=False)
    return artifact.kernel_source, None if seen.module is None else check_module(seen.module)


@functools.cache
def tcgen05_atom(m: int, n: int, k: int, in_dtype: str) -> bool | None:
    """Whether TileLang's sm100 lowering has a single-CTA tcgen05 atom for an M x N x K gemm tile
    with ``in_dtype`` inputs and fp32 accumulation (it fails late, with "TCGEN05 meta not
    initialized", where it has none); None where TileLang cannot be asked here."""
    try:
        from tilelang import _ffi_api, tvm
    except ImportError:
        return None
    meta = _ffi_api.get_tcgen5_mma_meta(m, n, k, tvm.DataType(in_dtype), tvm.DataType("float32"), True, False)
    return len(meta) > 0


def include_dirs() -> list[str]:
    import tilelang

    root = Path(tilelang.__file__).parent
    return [str(root / "src"), str(root / "3rdparty" / "cutlass" / "include"),
            str(root / "3rdparty" / "tvm" / "include")]


def device_flags(configs: dict) -> list[str]:
    """The nvcc flags TileLang's JIT adds for these pass options (``tilelang.cuda.backend``), so an
    offline build compiles what the GPU runs."""
    extra = configs.get("tl.device_compile_flags") or []
    flags = shlex.split(extra) if isinstance(extra, str) else [str(f) for f in extra]
    return flags + (["--use_fast_math"] if configs.get("tl.enable_fast_math") else [])


def nvcc(cu_path: str, sm: str, out_path: str, kind: str, flags: list[str] = (), ptx_path: str | None = None) -> str:
    """``kind``: 'cubin' or 'ptx'; ``flags``: more nvcc options (``device_flags``). A cubin build
    given ``ptx_path`` also leaves the PTX it assembled there (nvcc's kept intermediate: one front
    end run for both). Returns nvcc's messages (for a cubin, ptxas's resource report); raises
    RuntimeError with nvcc's message on failure."""
    exe = shutil.which("nvcc")
    if exe is None:
        raise RuntimeError("nvcc is not on PATH: cannot compile generated CUDA")
    verbose = ["-Xptxas", "-v"] if kind == "cubin" else []
    keep = Path(out_path).parent / f".{Path(out_path).stem}-keep" if kind == "cubin" and ptx_path else None
    if keep is not None:
        keep.mkdir(exist_ok=True)
    cmd = [exe, "-std=c++17", f"-arch={sm}", f"-{kind}", "-O3", "-w", *verbose, *flags,
           *(["-keep", f"--keep-dir={keep}"] if keep is not None else []),
           *(f"-I{d}" for d in include_dirs()), cu_path, "-o", out_path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc -arch={sm} -{kind} failed:\n{proc.stderr[-4000:]}")
        if keep is not None:
            shutil.move(str(keep / f"{Path(cu_path).stem}.ptx"), ptx_path)
    finally:
        if keep is not None:
            shutil.rmtree(keep, ignore_errors=True)
    return proc.stderr + proc.stdout


def ptxas_stats(report: str) -> dict[str, int]:
    """What ptxas says of the kernel: registers a thread at launch (with ``setmaxnreg`` the warp
    groups then trade them), bytes of local-memory spills, stack bytes, and whether it serialised
    the wgmma instructions (1: every wgmma waited for at once). Empty if it said nothing."""
    out = {}
    for key, pattern in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame")):
        found = [int(x) for x in re.findall(pattern, report)]
        if found:
            out[key] = max(found)
    if out:  # C7514: ptxas waits for every wgmma at once (a fragment read while one is in flight)
        out["wgmma_serialized"] = int("C7514" in report or "instructions are serialized" in report)
    return out


def cuobjdump() -> str | None:
    """A cuobjdump to read SASS with: the toolkit's, the one Triton's wheel ships, or NVIDIA's
    ``nvidia-cuda-cuobjdump`` wheel's (``pip install nvidia-cuda-cuobjdump``, for a machine whose
    toolkit has nvcc but no cuobjdump)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for package, parts in (("triton", ("backends", "nvidia", "bin")), ("nvidia", ("cu13", "bin"))):
        try:
            module = importlib.import_module(package)
        except ImportError:
            continue
        for root in getattr(module, "__path__", ()):  # a package (nvidia is a namespace package)
            cand = Path(root).joinpath(*parts, "cuobjdump")
            if cand.exists():
                return str(cand)
    return None


def sass(cubin_path: str) -> str | None:
    tool = cuobjdump()
    if tool is None:
        return None
    proc = subprocess.run([tool, "-sass", cubin_path], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None
