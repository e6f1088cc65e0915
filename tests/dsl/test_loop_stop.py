"""A loop's stop read from data (``dsl.range`` / ``dsl.pipelined`` with ``stop=``): a one-element
integer tile ends the loop at the smaller of it and the static extent."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.dsl.errors import DslError, UnsupportedError


@dsl.kernel
def prefix_sum(x: dsl.Tensor["R", "K", dsl.f32], n: dsl.Tensor["R", dsl.i32], y: dsl.Tensor["R", dsl.f32], *,
               BK: dsl.Tunable = dsl.choice(16), START: dsl.Const = 0, PIPELINED: dsl.Const = False):
    for r in dsl.grid(x.R):
        acc = dsl.zeros((1,), dsl.f32)
        steps = dsl.load(n[r], (1,))
        loop = dsl.pipelined(dsl.cdiv(x.K, BK), stages=2, start=START, stop=steps) if PIPELINED else \
            dsl.range(dsl.cdiv(x.K, BK), start=START, stop=steps)
        for k in loop:
            acc[:] = acc + dsl.load(x[r, k * BK], (1, BK)).sum(axis=1)
        dsl.store(y[r], acc)


def _want(x, n, start, bk=16):
    blocks = x.shape[1] // bk
    return torch.stack([x[i, start * bk:bk * max(start, min(blocks, int(n[i])))].sum() for i in range(x.shape[0])])


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("start", [0, 2])
def test_the_loop_ends_at_the_smaller_of_its_extent_and_its_stop(pipelined, start):
    x = torch.randn(6, 64)
    n = torch.tensor([0, 1, 3, 4, 9, -5], dtype=torch.int32)  # none, some, all, past the extent, negative
    y = torch.empty(6)
    codegen.compile(prefix_sum, "interpret", constants={"START": start, "PIPELINED": pipelined})(x=x, n=n, y=y)
    torch.testing.assert_close(y, _want(x, n, start))


def test_the_printed_ir_shows_both_ends():
    module = prefix_sum.trace()
    (loop,) = [op for op in module.walk() if op.name == "for"]
    assert len(loop.args) == 1 and "< min(ceiling(K/16), %" in str(module)


@pytest.mark.parametrize("stop, why", [
    ("3", "a one-element integer tile read from data, got 3"),
    ("dsl.load(f[r], (1,))", "a one-element integer tile, got f32[1]"),
    ("dsl.load(n[r], (1,)) > 0", "a one-element integer tile, got i1[1] vector (a condition gates"),
    ("dsl.load(m[r, 0], (1, 2))", "a one-element integer tile, got i32[1x2]"),
])
def test_a_stop_that_is_not_a_one_element_integer_tile_is_refused_at_its_line(stop, why):
    src = f'''
@dsl.kernel
def bad(x: dsl.Tensor["R", "K", dsl.f32], n: dsl.Tensor["R", dsl.i32], f: dsl.Tensor["R", dsl.f32],
        m: dsl.Tensor["R", "K", dsl.i32], y: dsl.Tensor["R", dsl.f32]):
    for r in dsl.grid(x.R):
        for k in dsl.range(4, stop={stop}):
            dsl.store(y[r], dsl.load(f[r], (1,)))
'''
    scope = {"dsl": dsl}
    exec(compile(src, "stop_kernel.py", "exec"), scope)
    with pytest.raises(DslError, match="stop") as err:
        scope["bad"].trace()
    assert why in str(err.value) and "stop_kernel.py:6" in str(err.value)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_targets_read_the_stop_into_a_scalar_and_build(target, tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    kernel = codegen.compile(prefix_sum, target, constants={"PIPELINED": True})
    with torch.device("meta"):
        (art,) = kernel.artifacts(x=torch.empty(6, 64), n=torch.empty(6, dtype=torch.int32), y=torch.empty(6))
    src = art.stages["tilelang"]
    assert 'k_stop = T.alloc_var("int32")' in src and "T.Pipelined(0, T.min(4, k_stop)" in src
    assert "min(4, k_stop)" in art.stages["cuda"] and art.files["cubin"]


def test_manual_warp_specialisation_refuses_a_stop_read_from_data():
    @dsl.kernel
    def gemm_upto(a: dsl.Tensor["M", "K", dsl.bf16], b: dsl.Tensor["N", "K", dsl.bf16], n: dsl.Tensor["M", dsl.i32],
                  c: dsl.Tensor["M", "N", dsl.bf16]):
        for m, j in dsl.grid(dsl.cdiv(a.M, 64), dsl.cdiv(b.N, 64)):
            acc = dsl.zeros((64, 64), dsl.f32, role="accumulator")
            for k in dsl.pipelined(dsl.cdiv(a.K, 64), stages=2, stop=dsl.load(n[m], (1,))):
                dsl.gemm(dsl.load(a[m * 64, k * 64], (64, 64), role="operand"),
                         dsl.load(b[j * 64, k * 64], (64, 64), role="operand"), acc, transpose_b=True)
            dsl.store(c[m * 64, j * 64], acc.to(dsl.bf16))

    kernel = codegen.compile(gemm_upto, "sm90", config={"warp_specialize": "manual"})
    with torch.device("meta"), pytest.raises(UnsupportedError, match="not a stop read from data") as err:
        kernel.artifacts(a=torch.empty(128, 256, dtype=torch.bfloat16), b=torch.empty(128, 256, dtype=torch.bfloat16),
                         n=torch.empty(128, dtype=torch.int32), c=torch.empty(128, 128, dtype=torch.bfloat16))
    assert "test_loop_stop.py" in str(err.value)


def test_ascend_refuses_a_stop_read_from_data_naming_the_line():
    kernel = codegen.compile(prefix_sum, "ascend950")
    with torch.device("meta"), pytest.raises(UnsupportedError, match="stop is read from a tensor") as err:
        kernel.artifacts(x=torch.empty(64, 64), n=torch.empty(64, dtype=torch.int32), y=torch.empty(64))
    assert "test_loop_stop.py" in str(err.value)
