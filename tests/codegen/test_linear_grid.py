"""A grid whose outer axes may pass CUDA's 65,535-block limit on ``blockIdx.y`` / ``.z`` is
launched along one axis and decoded (codegen/tilelang_cuda/linear_grid.py). Found on the H200:
``kv_round`` at 4,096 tokens x 64 heads launched grid (4, 65536) and failed with
``CUDA_ERROR_INVALID_VALUE``."""

from __future__ import annotations

import itertools
import shutil

import pytest
import sympy

from duotile.codegen.tilelang_cuda.linear_grid import linear_head, needs_linear_grid


def test_outer_axes_over_the_limit_or_dynamic_need_the_linear_grid():
    n = sympy.Symbol("n_T")
    assert needs_linear_grid([65536, 4])
    assert needs_linear_grid([sympy.ceiling(n / 4), 4])
    assert needs_linear_grid([3, 70000, 5])
    assert not needs_linear_grid([65535, 4])
    assert not needs_linear_grid([4, 10**7])  # the innermost axis is blockIdx.x: 2^31 - 1
    assert not needs_linear_grid([10**7])


def test_the_decode_walks_every_block_once_innermost_fastest():
    names, extents = ["z", "y", "x"], [3, 4, 5]
    head = linear_head(names, extents, 128)
    assert head[0] == "with T.Kernel(60, threads=128) as (grid_id,):"
    seen = []
    for grid_id in range(60):
        env = {"grid_id": grid_id}
        for line in head[1:]:
            exec(line.strip(), {}, env)  # noqa: S102 - our own generated binding lines
        seen.append((env["z"], env["y"], env["x"]))
    assert seen == list(itertools.product(range(3), range(4), range(5)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kv_round_at_the_h200_failing_shape_launches_one_axis():
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import build_case
    from duotile.kernels_spec import load_all

    spec = load_all()["kv_round"]
    name = "v4/index_q_mxfp4_h64_d128/prefill4096"
    r = build_case(spec, name, spec.model_cases()[name], "sm90")
    assert r.ok, r.error
    src, cuda = r.artifact.stages["tilelang"], r.artifact.stages["cuda"]
    assert "as (grid_id,):" in src and "t = grid_id // 4" in src
    assert "blockIdx.x" in cuda and "blockIdx.y" not in cuda


def test_a_decode_by_a_dynamic_size_truncates_and_walks_every_block_once():
    """Block numbers and extents are never negative, so a decode by a dynamic size is written
    T.truncdiv / T.truncmod: TVM cannot see a size's sign and wrote its floor division as a
    truncating one corrected by sign tests in every address using the result (the block-scaled
    GEMM's scale loads in its K loop, 41 such corrections in its CUDA). Such a decode is computed
    once, into a register (T.alloc_var); an axis of extent 1 is 0."""
    n = sympy.Symbol("n_M", integer=True, positive=True)
    head = linear_head(["g", "m", "n"], [2, sympy.ceiling(n / 64), 128], 256)
    assert head[1:] == ["    n = grid_id % 128",
                        '    m = T.alloc_var("int32", init=T.truncmod(grid_id // 128, T.ceildiv(n_M, 64)))',
                        '    g = T.alloc_var("int32", init=T.truncdiv(grid_id, 128 * T.ceildiv(n_M, 64)))']
    assert linear_head(["g", "m", "n"], [1, sympy.ceiling(n / 64), 128], 256)[1:] == [
        "    n = grid_id % 128", "    m = grid_id // 128", "    g = 0"]
    ops = type("T", (), {"ceildiv": staticmethod(lambda a, b: -(-a // b)),
                         "truncdiv": staticmethod(lambda a, b: int(a / b)),
                         "truncmod": staticmethod(lambda a, b: a - int(a / b) * b),
                         "alloc_var": staticmethod(lambda dtype, init: init)})
    for groups, rows in itertools.product((1, 2), (1, 64, 200)):
        head = linear_head(["g", "m", "n"], [groups, sympy.ceiling(n / 64), 128], 256)
        seen = []
        for grid_id in range(groups * -(-rows // 64) * 128):
            env = {"grid_id": grid_id, "T": ops, "n_M": rows}
            for line in head[1:]:
                exec(line.strip(), {}, env)  # noqa: S102 - our own generated binding lines
            seen.append((env["g"], env["m"], env["n"]))
        assert seen == list(itertools.product(range(groups), range(-(-rows // 64)), range(128)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_block_scaled_gemms_cuda_has_no_sign_corrected_division():
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import build_case
    from duotile.kernels_spec import load_all

    spec = load_all()["gemm_blockscaled"]
    case = {"G": 2, "M": 200, "N": 256, "K": 256, "BLOCK": 128}  # groups: a decode by the row count
    r = build_case(spec, "dynamic_rows", case, "sm90", config={"BM": 64, "BN": 128, "BK": 128, "STAGES": 2,
                                                                 "SPLIT": 1}, use_tuned=False)
    assert r.ok, r.error
    assert "T.truncmod(grid_id" in r.artifact.stages["tilelang"]
    assert "rmod" not in r.artifact.stages["cuda"] and "rdiv" not in r.artifact.stages["cuda"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_block_scaled_gemms_loop_reads_its_decoded_block_from_registers():
    """On the H200 the block-scaled GEMM ran 2.3x slower on the linear grid than on grid axes
    (V4's wq_b at 4,096 rows: 1,175 us against 512, same config): TileLang inlined the decode into
    every address, and the scale loads in the K loop each recomputed a 64-bit division by the row
    count. Today the K split's decode is read from registers, and a grid of one group decodes
    with shifts alone."""
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import build_case
    from duotile.kernels_spec import load_all

    spec = load_all()["gemm_blockscaled"]
    case = {"G": 1, "M": 200, "N": 256, "K": 512, "BLOCK": 128}
    for split in (1, 4):
        config = {"BM": 64, "BN": 128, "BK": 128, "STAGES": 2, "SPLIT": split}
        r = build_case(spec, "dynamic_rows", case, "sm90", config=config, use_tuned=False)
        assert r.ok, r.error
        cuda = r.artifacts[0].stages["cuda"]
        loads = [line for line in cuda.splitlines() if "a_scale[" in line or "b_scale[" in line]
        assert loads and not [line for line in loads if "/" in line or "%" in line], split
        assert ("g = 0" in r.artifacts[0].stages["tilelang"]) == (split == 1)  # one group: no decode
