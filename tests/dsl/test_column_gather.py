"""A gather along a tile's last axis (``x[i, col + 2 * dsl.arange(n)]``): every other column of a
row tile, the pairing the FP4 quantiser packs into bytes. Its meaning on the interpreter (columns
past the tensor read ``other``), fuse_elementwise keeping an index tile computed from loop indices
alone as a value when a gather reads it (it recomputes such tiles only inside elementwise users),
and its lowerings: TileLang text for sm90 / sm100 (nvcc builds in the slow test) and ascend950."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.passes.fuse_elementwise import fuse_elementwise
from duotile.passes.verify_ir import verify_ir


@dsl.kernel
def deinterleave(x: dsl.Tensor["R", "C", dsl.f32], even: dsl.Tensor["R", "H", dsl.f32],
                 odd: dsl.Tensor["R", "H", dsl.f32], *, BR: dsl.Const = 4, BH: dsl.Const = 16):
    for i, j in dsl.grid(dsl.cdiv(x.R, BR), dsl.cdiv(even.H, BH)):
        cols = j * (2 * BH) + 2 * dsl.arange(BH)  # index math alone: an iota, a multiply, an add
        dsl.store(even[i * BR, j * BH], dsl.load(x[i * BR, cols], (BR, BH), other=-1.0))
        dsl.store(odd[i * BR, j * BH], dsl.load(x[i * BR, cols + 1], (BR, BH), other=-1.0))


def run(r: int, c: int):
    x = torch.randn(r, c)
    h = -(-c // 2)
    even, odd = torch.full((r, h), 7.0), torch.full((r, h), 7.0)
    codegen.compile(deinterleave, "interpret")(x=x, even=even, odd=odd)
    return x, even, odd


def test_every_other_column_and_the_columns_past_the_tensor_read_other():
    x, even, odd = run(6, 45)  # ragged rows and columns; the last odd column lies past the tensor
    assert torch.equal(even, x[:, 0::2])
    assert torch.equal(odd[:, :22], x[:, 1::2]) and torch.equal(odd[:, 22], torch.full((6,), -1.0))


def test_fusion_keeps_an_index_only_tile_that_a_gather_reads():
    module = deinterleave.trace()
    fused = verify_ir(fuse_elementwise(module))  # the gathers' index tiles are defined before them
    ops = [op for op in fused.walk() if op.name in ("map", "gather")]
    gathers = [op for op in ops if op.name == "gather"]
    assert len(gathers) == 2
    defined = {op.result.id for op in ops if op.name == "map"}
    assert all(g.args[0].id in defined for g in gathers)


def _module(target: str):
    sig = deinterleave.bind({"x": torch.empty(64, 64, device="meta"), "even": torch.empty(64, 32, device="meta"),
                             "odd": torch.empty(64, 32, device="meta")})
    return specialize(deinterleave, sig, target)


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_reads_the_columns_through_the_index_fragment(target):
    pytest.importorskip("tilelang")
    module, knobs = _module(target)
    text = get_target(target).generate(module, knobs).stages["tilelang"]
    index = [line.split(" = ")[0].strip() for line in text.splitlines() if "(2 * i0))" in line]
    assert len(index) == 1 and index[0].endswith("_frag[i0]")  # the index tile: a fragment of its own
    frag = index[0][: -len("[i0]")]
    gathered = [line for line in text.splitlines() if "T.if_then_else" in line and "x[4 * i + i0, " in line]
    assert len(gathered) == 2
    assert f"x[4 * i + i0, {frag}[i1]]" in gathered[0] and f"({frag}[i1] < 64)" in gathered[0]


def test_ascend_lowers_the_column_gather_in_a_simt_region():
    pytest.importorskip("tilelang")
    module, knobs = _module("ascend950")
    text = get_target("ascend950").generate(module, knobs).stages["tilelang"]
    gathered = [line for line in text.splitlines() if "T.if_then_else" in line]
    assert len(gathered) == 2 and all("x[4*i_i + r0, T.max(T.min(" in line for line in gathered)
    assert text.count("with T.SimtVF(") == 2  # each gather with its index tile in a SIMT region


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_cuda_builds(target, tmp_path):
    pytest.importorskip("tilelang")
    from duotile.codegen.build import build_module

    module, knobs = _module(target)
    art = build_module(deinterleave, module, get_target(target), knobs, workdir=str(tmp_path), use_cache=False)
    assert art.files["cubin"].endswith(".cubin")
