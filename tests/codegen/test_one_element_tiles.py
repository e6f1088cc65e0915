"""A one-element tile loaded per grid point (a sequence's length or position) and broadcast into
a mask: the interpreter's meaning, and on sm90 / sm100 a thread-local value every thread loads
itself (TileLang found no fragment layout for a one-element fragment read in a larger parallel
loop); a one-element tile that a store reads stays a fragment. So is one that a gather or a
scatter reads as its row index, and a map of one-element reduction results (a row's rsqrt):
kv_insert's V4.1 row (the ring slot, the position its cos / sin rows are read at, the row's rsqrt
read by every channel block) failed on sm90 / sm100 with "no available layout found"."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target


@dsl.kernel
def masked_rows(x: dsl.Tensor["B", "N", dsl.f32], lens: dsl.Tensor["B", dsl.i32],
                y: dsl.Tensor["B", "N", dsl.f32], *, BN: dsl.Tunable = dsl.choice(64)):
    for b, j in dsl.grid(x.B, dsl.cdiv(x.N, 2 * BN)):
        keep = dsl.load(lens[b], (1,), other=-1) // 2  # half the length, rounded down
        for jj in dsl.range(2):  # two column blocks a program: `keep` is computed once, before
            col = (2 * j + jj) * BN
            dsl.store(y[b, col], dsl.where(col + dsl.arange(BN) < keep, dsl.load(x[b, col], (BN,)), float("-inf")))


@dsl.kernel
def copy_len(lens: dsl.Tensor["B", dsl.i32], out: dsl.Tensor["B", dsl.i32]):
    for b in dsl.grid(lens.B):
        dsl.store(out[b], dsl.load(lens[b], (1,)) + 1)


@dsl.kernel
def ring_rows(x: dsl.Tensor["B", "N", dsl.f32], table: dsl.Tensor["P", "N", dsl.f32], pos: dsl.Tensor["B", dsl.i32],
              ring: dsl.Tensor["B", "W", "N", dsl.f32]):
    for b in dsl.grid(x.B):
        p = dsl.load(pos[b], (1,))  # the row a gather and a scatter name
        row = dsl.load(x[b, 0], (1, x.N))
        r = dsl.rsqrt((row * row).sum(axis=1) / x.N + 1e-6)  # a map of a one-element reduction result
        slot = p % ring.W
        for j in range(2):  # two column blocks read r and the slot
            dsl.store(ring[b, slot, 32 * j], dsl.load(x[b, 32 * j], (1, 32)) * r[:, None]
                      * dsl.load(table[p, 32 * j], (1, 32)))


def _tensors(b=3, n=100):
    x = torch.randn(b, n)
    lens = torch.tensor([0, 7, 1000][:b], dtype=torch.int32)
    return {"x": x, "lens": lens, "y": torch.full((b, n), float("nan"))}


def test_interpreter_broadcasts_the_element_per_grid_point():
    t = _tensors()
    codegen.compile(masked_rows, "interpret")(**t)
    keep = (t["lens"].long() // 2)[:, None]
    want = torch.where(torch.arange(100)[None, :] < keep, t["x"], torch.tensor(float("-inf")))
    assert torch.equal(t["y"], want)
    assert bool(torch.isinf(t["y"][0]).all()) and int(torch.isfinite(t["y"][1]).sum()) == 3


def _tilelang(kernel, tensors, target):
    module, knobs = specialize(kernel, kernel.bind(tensors), target, {})
    return module, knobs, get_target(target).generate(module, knobs).stages["tilelang"]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_keeps_the_element_in_each_thread(target):
    pytest.importorskip("tilelang")
    _, _, text = _tilelang(masked_rows, _tensors(), target)
    assert 'lens0_local = T.alloc_local((1,), "int32")' in text
    assert "lens0_local[0] = T.if_then_else((b < 3), lens[b], -1)" in text
    assert "t1_local[0] = T.floordiv(lens0_local[0], 2)" in text  # the map of it: no parallel loop
    assert "T.Parallel(1)" not in text and "< t1_local[0]" in text
    _, _, stored = _tilelang(copy_len, {"lens": torch.zeros(4, dtype=torch.int32),
                                        "out": torch.zeros(4, dtype=torch.int32)}, target)
    assert 't1_frag = T.alloc_fragment((1,), "int32")' in stored  # a store reads it: a fragment
    assert "lens0_local[0] = " in stored  # its input, which a map reads, is local


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_keeps_indices_and_maps_of_reductions_in_each_thread(target):
    pytest.importorskip("tilelang")
    ring = {"x": torch.zeros(3, 64), "table": torch.zeros(10, 64), "pos": torch.zeros(3, dtype=torch.int32),
            "ring": torch.zeros(3, 4, 64)}
    _, _, text = _tilelang(ring_rows, ring, target)
    assert 'pos0_local = T.alloc_local((1,), "int32")' in text and "pos0_frag" not in text
    assert "table[pos0_local[0], " in text  # the gather's row
    assert "t4_local[0] = T.rsqrt(((t3_frag[0] / 64) + " in text  # the reduction's result stays a fragment
    assert text.count("* t4_local[0])") == 2
    assert "t5_local[0] = T.floormod(pos0_local[0], 4)" in text
    assert text.count("ring[b, t5_local[0], ") == 2 and "T.Parallel(1)" not in text  # the scatter's row


@pytest.mark.slow
def test_kv_insert_v41_row_lowers_for_sm90(tmp_path):
    """The shape sweep's kv_insert draw B = 16, D = 128, FORMAT fp8 (V4.1's row: e4m3 values and
    a UE8M0 code per 32 channels), f32 rows and i64 positions, at the defaults (no tuning entry).
    The model shapes build in full on sm90 and sm100 in test_model_shape_builds / test_cuda_build."""
    pytest.importorskip("tilelang")
    from duotile.codegen.tilelang_cuda import toolchain
    from duotile.kernels_spec import load_all

    spec = load_all()["kv_insert"]
    case = {"B": 16, "D": 128, "P": 511, "W": 1, "FORMAT": "fp8", "dtype": "f32", "index": "i64"}
    tgt = get_target("sm90")
    module, knobs = specialize(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), "sm90", {},
                               spec.constants_of(case))
    text = tgt.generate(module, knobs).stages["tilelang"]
    assert 'positions0_local = T.alloc_local((1,), "int64")' in text
    py = tmp_path / "kv_insert.py"
    py.write_text(text)
    prim, configs = toolchain.load_generated(str(py), "kv_insert_kernel")
    assert "__global__" in toolchain.lower_to_cuda(prim, tgt.arch.sm, configs)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_the_broadcast_element_compiles(target, tmp_path):
    """Regression: TileLang's layout inference failed ("no available layout found") on the
    one-element fragment this used to be."""
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    ints = {"lens": torch.zeros(4, dtype=torch.int32), "out": torch.zeros(4, dtype=torch.int32)}
    for kernel, tensors in ((masked_rows, _tensors()), (copy_len, ints)):
        module, knobs, _ = _tilelang(kernel, tensors, target)
        art = build_module(kernel, module, get_target(target), knobs, workdir=str(tmp_path / kernel.name),
                           use_cache=False)
        assert art.files["cubin"].endswith(".cubin") and "lens0_local[0] = lens[" in art.stages["cuda"]
