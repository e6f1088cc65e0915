"""Offsets read from data (``dsl.scalar``): a one-element integer tile as an index symbol that
loads and stores may use; a load outside the tensor reads zeros, a store there is dropped."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.dsl.errors import DslError, UnsupportedError


@dsl.kernel
def rows_from(x: dsl.Tensor["N", "D", dsl.f32], first: dsl.Tensor["B", dsl.i32], y: dsl.Tensor["B", "R", "D", dsl.f32],
              *, R: dsl.Const = 4):
    for b in dsl.grid(first.B):
        start = dsl.scalar(dsl.load(first[b], (1,)))
        rows = dsl.load(x[start, 0], (R, x.D), other=-1.0)
        dsl.store(y[b, 0, 0], rows * 2.0)


@dsl.kernel
def pick_plane(x: dsl.Tensor["E", "N", "D", dsl.f32], which: dsl.Tensor["B", dsl.i32],
               out: dsl.Tensor["B", "N", "D", dsl.f32]):
    for b in dsl.grid(which.B):
        e = dsl.scalar(dsl.load(which[b], (1,)))
        cols = dsl.arange(x.D)
        dsl.store(out[b, 0, 0], dsl.load(x[e, 0, cols], (x.N, x.D)))  # a gather after a data index


def _rows_want(x, first, r=4):
    out = torch.full((first.numel(), r, x.shape[1]), -2.0)
    for b, s in enumerate(first.tolist()):
        for i in range(r):
            if 0 <= s + i < x.shape[0]:
                out[b, i] = 2 * x[s + i]
    return out


def test_a_data_offset_reads_zeros_or_other_outside_the_tensor_on_the_interpreter():
    x, first = torch.randn(10, 32), torch.tensor([0, 3, 8, -2, 40], dtype=torch.int32)
    y = torch.empty(5, 4, 32)
    codegen.compile(rows_from, "interpret")(x=x, first=first, y=y)
    torch.testing.assert_close(y, _rows_want(x, first))
    x3, which = torch.randn(3, 5, 8), torch.tensor([2, -1, 0, 3], dtype=torch.int32)
    out = torch.empty(4, 5, 8)
    codegen.compile(pick_plane, "interpret")(x=x3, which=which, out=out)
    want = torch.stack([x3[i] if 0 <= i < 3 else torch.zeros(5, 8) for i in which.tolist()])
    torch.testing.assert_close(out, want)


def test_the_printed_ir_binds_the_symbol_where_it_is_read():
    text = str(rows_from.trace())
    assert "start = scalar(%" in text and "load x[start, 0]" in text


@pytest.mark.parametrize("body, why, line", [
    ("s = dsl.scalar(3)", "takes a one-element integer tile, got 3", 6),
    ("s = dsl.scalar(dsl.load(f[b], (1,)))", "got f32[1]", 6),
    ("s = dsl.scalar(dsl.load(m[b, 0], (1, 2)))", "got i32[1x2]", 6),
    ("s = dsl.scalar(dsl.load(n[b], (1,)))\n        for k in dsl.range(s):\n            pass", "bounds use s", 7),
])
def test_a_misused_scalar_is_refused_at_its_line(body, why, line):
    src = f'''
@dsl.kernel
def bad(n: dsl.Tensor["B", dsl.i32], f: dsl.Tensor["B", dsl.f32], m: dsl.Tensor["B", "K", dsl.i32],
        y: dsl.Tensor["B", dsl.f32]):
    for b in dsl.grid(n.B):
        {body}
        dsl.store(y[b], dsl.load(f[b], (1,)))
'''
    scope = {"dsl": dsl}
    exec(compile(src, "scalar_kernel.py", "exec"), scope)
    with pytest.raises(DslError) as err:
        codegen.compile(scope["bad"], "interpret")(n=torch.zeros(2, dtype=torch.int32), f=torch.zeros(2),
                                                   m=torch.zeros(2, 4, dtype=torch.int32), y=torch.zeros(2))
    assert why in str(err.value) and f"scalar_kernel.py:{line}" in str(err.value)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_targets_hold_the_scalar_and_guard_both_ends_of_its_offsets(target, tmp_path, monkeypatch):
    """The symbol may be negative or past the axis: a data offset's reads test both ends (a grid
    or loop variable's never go below 0), on a leading point index too."""
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    with torch.device("meta"):
        (rows,) = codegen.compile(rows_from, target).artifacts(x=torch.empty(10, 32), y=torch.empty(5, 4, 32),
                                                               first=torch.empty(5, dtype=torch.int32))
        (plane,) = codegen.compile(pick_plane, target).artifacts(x=torch.empty(3, 5, 8), out=torch.empty(4, 5, 8),
                                                                 which=torch.empty(4, dtype=torch.int32))
    src = rows.stages["tilelang"]
    assert 'start = T.alloc_var("int32")' in src and "(start + i0 >= 0)" in src and "(start + i0 < 10)" in src
    gather = next(line for line in plane.stages["tilelang"].splitlines() if "x[e, " in line)
    assert "(e >= 0)" in gather and "(e < 3)" in gather
    assert rows.files["cubin"] and plane.files["cubin"]


def test_manual_warp_specialisation_and_ascend_refuse_a_scalar_naming_the_line():
    @dsl.kernel
    def expert_gemm(a: dsl.Tensor["M", "K", dsl.bf16], b: dsl.Tensor["E", "N", "K", dsl.bf16],
                    which: dsl.Tensor["M", dsl.i32], c: dsl.Tensor["M", "N", dsl.bf16]):
        for m, j in dsl.grid(dsl.cdiv(a.M, 64), dsl.cdiv(b.N, 64)):
            e = dsl.scalar(dsl.load(which[m], (1,)))
            acc = dsl.zeros((64, 64), dsl.f32, role="accumulator")
            for k in dsl.pipelined(dsl.cdiv(a.K, 64), stages=2):
                dsl.gemm(dsl.load(a[m * 64, k * 64], (64, 64), role="operand"),
                         dsl.load(b[e, j * 64, k * 64], (64, 64), role="operand"), acc, transpose_b=True)
            dsl.store(c[m * 64, j * 64], acc.to(dsl.bf16))

    tensors = dict(a=torch.empty(128, 256, dtype=torch.bfloat16), b=torch.empty(2, 128, 256, dtype=torch.bfloat16),
                   which=torch.empty(128, dtype=torch.int32), c=torch.empty(128, 128, dtype=torch.bfloat16))
    with torch.device("meta"):
        with pytest.raises(UnsupportedError, match="not a scalar read from data") as err:
            codegen.compile(expert_gemm, "sm90", config={"warp_specialize": "manual"}).artifacts(**tensors)
        assert "test_scalar_offsets.py" in str(err.value)
        with pytest.raises(UnsupportedError, match="dsl.scalar. is not lowered for Ascend") as err:
            codegen.compile(expert_gemm, "ascend950").artifacts(**tensors)
        assert "test_scalar_offsets.py" in str(err.value)
