"""Loads and stores of tiles one element wide along an axis (codegen/tilelang_cuda/unit_axes.py).

TileLang's ``T.copy`` bounds each axis of a global region except those of extent 1, so a (BM, 1)
tile at a column past the tensor reads (or writes) outside it. ``gemm_blockscaled`` read the byte
after its activation scale codes at K = 192 with BK = 256 (the tiny V4.1's Engram projection, its
user config), and the NaN code it found there broke CUDA-graph runs of that model; swiglu_quant's
scale store at V4.1's 2,304-wide experts wrote past a row's 72 codes. The CUDA generators now emit
such tiles as guarded element loops unless the position is proven inside (codegen/tile_bounds.py);
a proven one keeps ``T.copy``. Ascend, which masks no copy, refuses a tile whose position is not
proven inside."""

from __future__ import annotations

import re

import pytest
import sympy
import torch

from duotile import codegen, dsl
from duotile.codegen.compile import specialize
from duotile.codegen.driver import generate_case
from duotile.codegen.target import get_target
from duotile.codegen.tile_bounds import largest
from duotile.dsl.errors import UnsupportedError
from duotile.kernels_spec import load_all

pytest.importorskip("tilelang")
CUDA = ("sm90", "sm100")


@dsl.kernel
def column_codes(x: dsl.Tensor["M", "KB", dsl.u8], y: dsl.Tensor["M", "KB", dsl.f32], *,
                 BM: dsl.Tunable = dsl.choice(64), STEP: dsl.Const = 4):
    for m in dsl.grid(dsl.cdiv(x.M, BM)):
        for k in dsl.range(dsl.cdiv(x.KB, STEP)):
            for j in range(STEP):  # the step's columns, whole steps: past KB where STEP does not divide it
                t = dsl.load(x[m * BM, k * STEP + j], (BM, 1))
                dsl.store(y[m * BM, k * STEP + j], t.to(dsl.f32) + 1.0)


@dsl.kernel
def row_blocks(x: dsl.Tensor["KB", "M", dsl.u8], y: dsl.Tensor["KB", "M", dsl.f32], *,
               BM: dsl.Tunable = dsl.choice(64), STEP: dsl.Const = 4):
    for m in dsl.grid(dsl.cdiv(x.M, BM)):
        for k in dsl.range(dsl.cdiv(x.KB, STEP)):
            for j in range(STEP):  # the leading axis at a computed block: past KB where STEP does not divide it
                t = dsl.load(x[k * STEP + j, m * BM], (BM,))
                dsl.store(y[k * STEP + j, m * BM], t.to(dsl.f32) + 1.0)


def _source(kernel, tensors: dict, target: str) -> str:
    module, knobs = specialize(kernel, kernel.bind(tensors), target, {})
    return get_target(target).generate(module, knobs).stages["tilelang"]


def _codes(kb: int, m: int = 70) -> dict:
    return {"x": torch.randint(0, 255, (m, kb), dtype=torch.uint8), "y": torch.zeros(m, kb)}


@pytest.mark.parametrize("target", CUDA)
def test_a_one_wide_column_past_the_tensor_is_guarded(target):
    """KB = 6 in steps of 4: columns 4k + 2 and 4k + 3 reach 7 at the last step and are guarded;
    4k and 4k + 1 reach 5 at most and keep T.copy."""
    src = _source(column_codes, _codes(6), target)
    loads = re.findall(r"= T\.if_then_else\((.*), x\[", src)
    stores = re.findall(r"if (.*):\n\s*y\[", src)
    assert len(loads) == 2 and len(stores) == 2, src
    assert all("4 * k + 2" in c or "4 * k + 3" in c for c in loads + stores), (loads, stores)
    assert all("< 6" in c for c in loads + stores), (loads, stores)
    assert src.count("T.copy(x[") == 2 and len(re.findall(r"T\.copy\([^)]*, y\[", src)) == 2, src


@pytest.mark.parametrize("target", CUDA)
def test_a_one_wide_column_proven_inside_keeps_t_copy(target):
    src = _source(column_codes, _codes(8), target)  # two whole steps of four: column 7 at most
    assert src.count("T.copy(x[") == 4 and len(re.findall(r"T\.copy\([^)]*, y\[", src)) == 4, src


def test_the_interpreter_reads_nothing_past_the_tensor():
    t = _codes(6)
    codegen.compile(column_codes, "interpret")(**t)
    torch.testing.assert_close(t["y"], t["x"].float() + 1.0, rtol=0, atol=0)


def test_largest_follows_loop_bounds_that_name_the_grid():
    s, k, m, n = sympy.symbols("s k m n_M")
    env = {s: sympy.Integer(3), k: 4 * s + 3, m: sympy.ceiling(n / 64) - 1}
    assert largest(2 * k + 3, env) == 33  # split-K's last range, the next step's block prefetched
    assert largest(64 * m, env) == 64 * sympy.ceiling(n / 64) - 64
    assert largest(sympy.Mod(k, 5), env) == 4
    assert largest(-k + 40, env) is None  # shrinks as k grows: not a largest value by substitution


def test_gemm_blockscaled_guards_its_scale_codes_where_k_is_not_whole_steps():
    """The Engram projection of the tiny V4.1 as the runtime calls it: K = 192 in 32-wide blocks
    (KB = 6), FP32 out, the user's config: its K steps (BK = 128 or 256) hold 4 or 8 blocks, and
    those of the last step from block 6 on lie past K. Each read of such a block is guarded.
    (sm100's config takes the codes in the operands, a (BM, BK / 32) tile that T.copy bounds.)"""
    case = {"G": 1, "M": 20, "N": 1280, "K": 192, "BLOCK": 32, "out": "f32"}
    src = "\n".join(a.stages["tilelang"] for a in generate_case(load_all()["gemm_blockscaled"], case, "sm90"))
    bk = int(re.search(r"'BK': (\d+)", src).group(1))
    guarded = re.findall(r"T\.if_then_else\(([^\n]*?), a_scale\[", src)
    copied = re.findall(r"T\.copy\(a_scale\[[^,]*, [^,]*, ([^\]]*)\]", src)
    past = -(-192 // bk) * (bk // 32) - 6  # blocks of the last step at or past block 6
    assert len(guarded) == past and all("< 6" in r for r in guarded), (bk, guarded)
    assert len(copied) == bk // 32 - past, (bk, copied)


def test_ascend_refuses_a_tile_whose_position_may_run_past_the_tensor():
    """Ascend masks no copy (codegen/tilelang_ascend/check_whole_tiles.py): the same kernel lowers
    where every column is proven inside and is refused, naming the tensor and the position, where
    the last step's columns run past it."""
    with pytest.raises(UnsupportedError, match=r"x dimension 1 \(6 elements\) is read or written at 4\*k \+ 2"):
        _source(column_codes, _codes(6, m=128), "ascend950")
    assert "def column_codes" in _source(column_codes, _codes(8, m=128), "ascend950")


@pytest.mark.parametrize("target", CUDA)
def test_a_one_element_read_at_a_block_past_a_single_block_axis_is_guarded(target):
    """K = 16 in 32-wide blocks: one block of codes (KB = 1), and a K step of 128 holds four. The
    weight's code is one element (a (1, 1) tile every thread reads); its bounds test skipped axes
    of size 1, so blocks 1..3 read the bytes after ``b_scale``: NaN beside 0xFF fences on the H200
    (the GPU sweep's case random-seed20261207006, pinned here with its config)."""
    spec = load_all()["gemm_blockscaled"]
    case = {"G": 2, "M": 70, "N": 64, "K": 16, "BLOCK": 32, "scales": "normal", "zero_rows": True}
    config = {"BM": 64, "BN": 32, "BK": 128, "STAGES": 4, "SPLIT": 1, "SCALES": "promote"}
    module, knobs = specialize(spec.kernel, spec.kernel.bind(spec.meta_inputs(case)), target, config,
                               spec.constants_of(case))
    src = get_target(target).generate(module, knobs).stages["tilelang"]
    reads = re.findall(r"_local\[0, 0\] = (.*)b_scale\[g, n, ([^\]]+)\]", src)
    assert len(reads) >= 4, src
    for head, kb in reads:
        if kb != "0":  # block 0 is the one block there is
            assert head.startswith("T.if_then_else(") and f"{kb} < 1" in head, (head, kb)


def _rows(kb: int, m: int = 128) -> dict:
    return {"x": torch.randint(0, 255, (kb, m), dtype=torch.uint8), "y": torch.zeros(kb, m)}


@pytest.mark.parametrize("target", CUDA)
def test_a_leading_point_index_past_the_tensor_is_guarded(target):
    """A tile that does not span the leading axis is one element wide there too (T.copy leaves it
    unbounded): blocks 4k + 2 and 4k + 3 of KB = 6 reach 7 and are guarded, 4k and 4k + 1 keep
    T.copy; with KB = 8 every block is proven inside."""
    src = _source(row_blocks, _rows(6), target)
    loads = re.findall(r"= T\.if_then_else\((.*), x\[", src)
    stores = re.findall(r"if (.*):\n\s*y\[", src)
    assert len(loads) == 2 and len(stores) == 2, src
    assert all(("4 * k + 2" in c or "4 * k + 3" in c) and "< 6" in c for c in loads + stores), (loads, stores)
    src = _source(row_blocks, _rows(8), target)
    assert src.count("T.copy(x[") == 4 and "if_then_else" not in src, src


def test_ascend_refuses_a_leading_point_index_that_may_run_past_the_tensor():
    with pytest.raises(UnsupportedError, match=r"x dimension 0 \(6 elements\) is read or written at 4\*k \+ 2"):
        _source(row_blocks, _rows(6), "ascend950")
    assert "def row_blocks" in _source(row_blocks, _rows(8), "ascend950")


def test_the_interpreter_reads_no_leading_block_past_the_tensor():
    t = _rows(6)
    codegen.compile(row_blocks, "interpret")(**t)
    torch.testing.assert_close(t["y"], t["x"].float() + 1.0, rtol=0, atol=0)


def test_indexer_prefill_guards_the_rows_of_its_last_query_block():
    """indexer_logits_prefill scores BM queries a block, query m * BM + j at a leading point index
    of ``q``, ``w`` and ``logits``, with T dynamic: where T is not a multiple of BM the last block's
    queries lie past T. The generated source tested the key column alone (the point-index test
    covered indices read from data alone); TileLang's own bounds pass tested those rows at
    lowering (a variable index; lowered_bounds.py, run on the source before the rule, proves every
    access), so the built kernel stayed inside. The generator now tests them itself, as it must
    where an index is a constant, which that pass leaves alone."""
    spec = load_all()["indexer_logits_prefill"]
    src = "\n".join(a.stages["tilelang"] for a in generate_case(spec, spec.model_shapes["v41/r1_ctx4k/prefill4096"],
                                                                "sm90"))
    bm = int(re.search(r"'BM': (\d+)", src).group(1))
    assert bm > 1, src
    for j in range(1, bm):
        row = f"({bm} * m + {j})"
        assert f"{row} < n_T" in src, (row, src)
        for store in re.findall(rf"if (.*):\n\s*logits\[{re.escape(row)},", src):
            assert f"{row} < n_T" in store, store
        assert not re.search(rf"T\.copy\((q|w)\[{re.escape(row)},", src), src
