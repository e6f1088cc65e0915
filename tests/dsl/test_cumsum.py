"""``dsl.cumsum``: prefix sums of an i32 row, inclusive or exclusive. Its meaning on the interpreter,
its type rule at the spec line and in verify_ir, the sm90 / sm100 lowering (the SCAN device helper
run by every thread between barriers; nvcc builds it in the slow test), the refusal of a tile of
several rows on CUDA, and the least i32 as a literal (TileLang refuses -2147483648 written out)."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.codegen.tilelang_cuda.exprs import literal
from duotile.dsl.errors import DslError, UnsupportedError
from duotile.passes.verify_ir import verify_ir
from tests.dsl.fragments import store_kernel


@dsl.kernel
def prefix(x: dsl.Tensor["B", "N", dsl.i32], out: dsl.Tensor["B", "N", dsl.i32], *, W: dsl.Const = 1024,
           EXCLUSIVE: dsl.Const = False):
    for b in dsl.grid(x.B):
        row = dsl.load(x[b, 0], (W,))
        dsl.store(out[b, 0], dsl.cumsum(row * 1, exclusive=EXCLUSIVE))  # a map's result: staged to shared


@dsl.kernel
def rows(x: dsl.Tensor["B", "N", dsl.i32], out: dsl.Tensor["B", "N", dsl.i32]):
    for _ in dsl.grid(1):
        dsl.store(out[0, 0], dsl.cumsum(dsl.load(x[0, 0], (4, 64))))


def _tensors(b=3, n=1000):
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randint(-5, 9, (b, n), generator=g, dtype=torch.int32),
            "out": torch.zeros(b, n, dtype=torch.int32)}


@pytest.mark.parametrize("exclusive", [False, True])
def test_prefix_sums_in_index_order(exclusive):
    t = _tensors()
    codegen.compile(prefix, "interpret", constants={"EXCLUSIVE": exclusive})(**t)
    want = torch.cumsum(t["x"], -1, dtype=torch.int32)
    assert torch.equal(t["out"], want - t["x"] if exclusive else want)


def test_only_i32_tiles_are_summed_named_at_the_spec_line():
    kernel = store_kernel("x: dsl.Tensor['B', 'N', dsl.i32], out: dsl.Tensor['B', 'N', dsl.i32]",
                          "dsl.cumsum(dsl.load(x[0, 0], (8,)).to(dsl.f32))")
    with pytest.raises(DslError, match=r"dsl.cumsum sums i32 tiles.*got f32") as err:
        codegen.compile(kernel, "interpret")(**_tensors())
    assert "fragment.py:3" in str(err.value)


def test_verify_ir_checks_the_types_of_the_op():
    with torch.device("meta"):
        meta = {"x": torch.empty(3, 1024, dtype=torch.int32), "out": torch.empty(3, 1024, dtype=torch.int32)}
    module, _ = specialize(prefix, prefix.bind(meta), "interpret", {})
    op = next(o for o in module.walk() if o.name == "cumsum")
    verify_ir(module)
    op.result.type = type(op.result.type)(op.result.type.shape, dsl.f32, op.result.type.role)
    with pytest.raises(DslError, match="cumsum sums i32 tiles"):
        verify_ir(module)


def _source(kernel, target, n=1024):
    with torch.device("meta"):
        meta = {"x": torch.empty(3, n, dtype=torch.int32), "out": torch.empty(3, n, dtype=torch.int32)}
    module, knobs = specialize(kernel, kernel.bind(meta), target, {})
    return get_target(target).generate(module, knobs).stages["tilelang"]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_targets_run_the_scan_helper_between_barriers(target):
    pytest.importorskip("tilelang")
    text = _source(prefix, target)
    assert "T.import_source(SCAN)" in text
    body = text[text.index("T.sync_threads()"):]
    order = [body.index(s) for s in ('"duotile_scan_sums"', "T.sync_threads()", '"duotile_scan_write"')]
    assert order[0] < body.index("T.sync_threads()", order[0]) < order[2]
    assert body.index("T.sync_threads()", order[2]) > order[2]  # the written row is waited for
    assert ", 4, 1024, 0)" in text  # 1,024 values over 256 threads: segments of 4, inclusive
    with pytest.raises(UnsupportedError, match=r"dsl.cumsum of a \(4, 64\) tile: one row at a time"):
        _source(rows, target, n=64)


def test_ascend_refuses_the_op_naming_it():
    pytest.importorskip("tilelang")
    with pytest.raises(UnsupportedError, match="cumsum"):
        _source(prefix, "ascend950")


def test_the_least_i32_is_written_as_arithmetic():
    assert literal(-(1 << 31), dsl.i32) == "(-2147483647 - 1)" and literal(-5, dsl.i32) == "-5"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_nvcc_builds_the_scan(tmp_path):
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    with torch.device("meta"):
        meta = {"x": torch.empty(3, 1024, dtype=torch.int32), "out": torch.empty(3, 1024, dtype=torch.int32)}
    module, knobs = specialize(prefix, prefix.bind(meta), "sm90", {})
    art = build_module(prefix, module, get_target("sm90"), knobs, workdir=str(tmp_path), use_cache=False)
    assert "__shfl_up_sync" in art.stages["cuda"] and "duotile_scan_write(" in art.stages["cuda"]


SCAN_HOST = r"""
#include <barrier>
#include <cstdio>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
static std::barrier<>* lockstep;
static int lanes[1024];
static thread_local int me;
// __shfl_up_sync over the whole block in lockstep: every thread posts its value, then reads lane - o of
// its own warp (its own value where lane < o), as the warp instruction does
static int shfl_up(unsigned, int v, int o) {
  lanes[me] = v;
  lockstep->arrive_and_wait();
  const int got = (me & 31) >= o ? lanes[me - o] : v;
  lockstep->arrive_and_wait();
  return got;
}
#define __shfl_up_sync shfl_up
"""

SCAN_MAIN = r"""
int main() {
  const int threads = THREADS, w = WIDTH, n = (w + threads - 1) / threads;
  std::vector<int> x(w), out(w), part(threads), warps(threads / 32 + 1);
  for (int i = 0; i < w; ++i) x[i] = (i * 7919) % 13 - 5;
  std::barrier<> sync(threads);
  lockstep = &sync;
  for (int exclusive = 0; exclusive < 2; ++exclusive) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        me = t;
        duotile_scan_sums(x.data(), part.data(), warps.data(), t, n, w);
        sync.arrive_and_wait();  // the barrier between the two calls
        duotile_scan_write(x.data(), part.data(), warps.data(), out.data(), t, n, w, exclusive);
      });
    for (auto& th : pool) th.join();
    for (int i = 0; i < w; ++i) std::printf("%d%c", out[i], i == w - 1 ? '\n' : ' ');
  }
  return 0;
}
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
@pytest.mark.parametrize("threads, width", [(256, 4096), (128, 1000), (256, 100), (64, 64)])
def test_the_scan_helper_itself_gives_the_prefix_sums(tmp_path, threads, width):
    """``SCAN``'s own source compiled for the host, each GPU thread an OS thread and the warp
    shuffle emulated in lockstep: inclusive and exclusive prefix sums of a row, for rows longer
    than, not a multiple of, and shorter than the threads."""
    import subprocess

    from duotile.codegen.tilelang_cuda.device_helpers import SCAN

    src = tmp_path / "scan.cpp"
    src.write_text(SCAN_HOST + SCAN + SCAN_MAIN.replace("THREADS", str(threads)).replace("WIDTH", str(width)))
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-o", str(tmp_path / "scan"), str(src)], check=True,
                   capture_output=True)
    lines = subprocess.run([str(tmp_path / "scan")], check=True, capture_output=True, text=True).stdout.split("\n")
    x = (torch.arange(width) * 7919) % 13 - 5
    inclusive = torch.cumsum(x, 0)
    assert [int(v) for v in lines[0].split()] == inclusive.tolist()
    assert [int(v) for v in lines[1].split()] == (inclusive - x).tolist()
