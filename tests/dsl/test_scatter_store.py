"""A store by an index tile (``dsl.store(y[idx, j], tile)``): each row of the tile goes to the row
its index names; an index < 0 or >= the size drops the row, and the other axes clip like a plain
store. Its type rules at the spec line, its text form, the workspace rule of verify_ir, its meaning
on the interpreter, its TileLang text for sm90 / sm100 (an nvcc build in the slow test) and the
ascend950 refusal naming the op and the target."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.dsl.errors import DslError, UnsupportedError
from duotile.passes.verify_ir import verify_ir


@dsl.kernel
def scatter_rows(x: dsl.Tensor["N", "D", dsl.f32], idx: dsl.Tensor["N", dsl.i32],
                 y: dsl.Tensor["R", "D", dsl.f32], *, BN: dsl.Const = 4, BD: dsl.Const = 8):
    for i, j in dsl.grid(dsl.cdiv(x.N, BN), dsl.cdiv(x.D, BD)):
        rows = dsl.load(idx[i * BN], (BN,), other=-1)
        dsl.store(y[rows, j * BD], dsl.load(x[i * BN, j * BD], (BN, BD)))


@dsl.kernel
def scatter_flat(pos: dsl.Tensor["N", dsl.i32], order: dsl.Tensor["P", dsl.i32], *, BN: dsl.Const = 8):
    """order[pos[n]] = n, the inverse of a permutation (a 1-d scatter)."""
    for i in dsl.grid(dsl.cdiv(pos.N, BN)):
        dsl.store(order[dsl.load(pos[i * BN], (BN,), other=-1)], i * BN + dsl.arange(BN))


def test_rows_go_where_the_index_names_and_the_rest_stay():
    x = torch.arange(6 * 11, dtype=torch.float32).reshape(6, 11)  # ragged rows and columns
    idx = torch.tensor([3, -1, 0, 7, 5, 1], dtype=torch.int32)  # -1 and 7 (>= R) drop their rows
    y = torch.full((7, 11), -5.0)
    codegen.compile(scatter_rows, "interpret")(x=x, idx=idx, y=y)
    want = torch.full((7, 11), -5.0)
    for n, r in enumerate(idx.tolist()):
        if 0 <= r < 7:
            want[r] = x[n]
    assert torch.equal(y, want)
    assert torch.equal(y[[2, 4, 6]], torch.full((3, 11), -5.0))  # rows no index names: untouched


def test_a_flat_scatter_inverts_a_permutation():
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(21, generator=g).to(torch.int32)  # 21 positions in tiles of 8: a ragged tile
    order = torch.full((21,), -9, dtype=torch.int32)
    codegen.compile(scatter_flat, "interpret")(pos=perm, order=order)
    assert torch.equal(order[perm.long()], torch.arange(21, dtype=torch.int32))


def test_the_index_must_be_one_int_tile_matching_a_tile_axis():
    def trace(body):
        @dsl.kernel
        def k(x: dsl.Tensor["N", "D", dsl.f32], y: dsl.Tensor["R", "D", dsl.f32]):
            for i in dsl.grid(1):
                body(x, y, i)
        return k.trace()

    tile = lambda x: dsl.load(x[0, 0], (4, 8))  # noqa: E731
    with pytest.raises(DslError, match="only one index of a store may be a tile"):
        trace(lambda x, y, i: dsl.store(y[dsl.arange(4), dsl.arange(8)], tile(x)))
    with pytest.raises(DslError, match="scatter indices must be int32 or int64, got f32"):
        trace(lambda x, y, i: dsl.store(y[dsl.arange(4).to(dsl.f32), 0], tile(x)))
    with pytest.raises(DslError, match=r"scatter index tile of shape \(5\) does not match .* size 4"):
        trace(lambda x, y, i: dsl.store(y[dsl.arange(5), 0], tile(x)))
    with pytest.raises(DslError, match="the scattered dimension must be one of the tile's dimensions"):
        trace(lambda x, y, i: dsl.store(y[dsl.arange(1), 0], dsl.load(x[0, 0], (8,))))
    with pytest.raises(DslError, match="cannot store a i32 tile into f32"):
        trace(lambda x, y, i: dsl.store(y[dsl.arange(4), 0], dsl.arange(4)[:, None] + 0 * dsl.arange(8)[None, :]))


def test_text_form_and_the_workspace_rule():
    text = str(scatter_rows.trace())
    line = next(s for s in text.splitlines() if s.strip().startswith("scatter "))
    assert "scatter y[0, 8*j] by %" in line and " <- %" in line and "axis=0" in line

    @dsl.kernel
    def through_scratch(idx: dsl.Tensor["N", dsl.i32], out: dsl.Tensor["N", dsl.i32]):
        ws = dsl.workspace("ws", (idx.N,), dsl.i32)
        for _ in dsl.grid(1):
            dsl.store(ws[dsl.load(idx[0], (8,))], dsl.arange(8))
        for _ in dsl.grid(1):
            dsl.store(out[0], dsl.load(ws[0], (8,)))

    verify_ir(through_scratch.trace())  # a scatter counts as the phase's write of the workspace


def _module(target: str):
    meta = {"x": torch.empty(64, 32, device="meta"), "idx": torch.empty(64, dtype=torch.int32, device="meta"),
            "y": torch.empty(100, 32, device="meta")}
    return specialize(scatter_rows, scatter_rows.bind(meta), target)


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_writes_each_element_under_a_row_guard(target):
    pytest.importorskip("tilelang")
    module, knobs = _module(target)
    text = get_target(target).generate(module, knobs).stages["tilelang"]
    lines = text.splitlines()
    at = next(n for n, s in enumerate(lines) if "T.Parallel(4, 8)" in s and "scatter" not in s
              and "y[" in lines[n + 2])
    guard, write = lines[at + 1].strip(), lines[at + 2].strip()
    row = write.split("y[")[1].split(",")[0]
    assert row.endswith("_frag[i0]")  # the index tile, one row index a tile row
    assert guard.startswith("if ") and f"({row} >= 0)" in guard and f"({row} < 100)" in guard
    assert f"y[{row}, 8 * j + i1] = " in write  # the column axis as a plain store's


def test_ascend_refuses_naming_the_op_and_the_target():
    pytest.importorskip("tilelang")
    module, knobs = _module("ascend950")
    with pytest.raises(UnsupportedError, match=r"ascend950: a scatter store .* \(op scatter\)") as err:
        get_target("ascend950").generate(module, knobs)
    assert "test_scatter_store.py" in str(err.value)  # the spec line of the store


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_builds(target, tmp_path):
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    module, knobs = _module(target)
    art = build_module(scatter_rows, module, get_target(target), knobs, workdir=str(tmp_path), use_cache=False)
    assert art.files["cubin"].endswith(".cubin")
