"""A one-element tile loaded per grid point (a sequence's length or position) and broadcast into
a mask: the interpreter's meaning, and on sm90 / sm100 a thread-local value every thread loads
itself (TileLang found no fragment layout for a one-element fragment read in a larger parallel
loop); a one-element tile that a store reads stays a fragment."""

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
