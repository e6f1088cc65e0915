"""sm100's refusal of the TMEM drains TileLang 0.1.15 cannot lay out (capacity.check_tmem_drains): a
64 x 192 accumulator over two warp groups. It met a user: the cost model chose it for V4.1's
router at a prefill chunk (N = 384), whose sm100 build then failed in TileLang with "Composition
stride divisibility" (found by benchmarks/lowered_bounds.py, which lowers every model shape)."""

from __future__ import annotations

import pytest

from duotile.codegen.compile import specialize
from duotile.dsl.errors import UnsupportedError
from duotile.kernels_spec import load_all

SPEC = load_all()["gemm"]
CASE = {"M": 4096, "N": 384, "K": 5120}


def _specialize(bm: int, bn: int, threads: int):
    config = {"BM": bm, "BN": bn, "BK": 64, "STAGES": 3, "threads": threads}
    return specialize(SPEC.kernel, SPEC.kernel.bind(SPEC.meta_inputs(CASE)), "sm100", config)


def test_a_64_row_accumulator_192_wide_over_two_warp_groups_is_refused_at_its_gemm_line():
    with pytest.raises(UnsupportedError, match=r"gemm\.py:\d+.*TMEM drain of a 64 x 192 accumulator over 2 warp "
                                               r"groups \(48 columns each"):
        _specialize(64, 192, 256)


@pytest.mark.parametrize("bm, bn, threads", [(64, 192, 128), (64, 192, 512), (128, 192, 256), (64, 256, 256),
                                             (64, 128, 256)])
def test_the_drains_tilelang_lays_out_are_kept(bm, bn, threads):
    _specialize(bm, bn, threads)  # each lowered through TileLang on 2026-12-07 (the test below: the user's)


@pytest.mark.slow
def test_the_v41_routers_prefill_build_on_sm100_lowers_through_tilelang(tmp_path):
    """The config a user gets at the model shape (no config given), lowered by TileLang without
    nvcc, every access proven inside (codegen/tilelang_cuda/lowered_bounds.py)."""
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import generate_case
    from duotile.codegen.tilelang_cuda import toolchain

    (art,) = generate_case(SPEC, SPEC.model_shapes["v41/router/prefill4096"], "sm100")
    path = tmp_path / "kernel_tilelang.py"
    path.write_text(art.stages["tilelang"])
    prim, configs = toolchain.load_generated(str(path), art.meta["entry"])
    cuda, report = toolchain.lower_checked(prim, "sm_100a", configs)
    assert "tcgen05" in cuda and report.unproven == [] and report.proven > 0


ATTENTION = load_all()["flash_attention"]
SWEEP_CASE = {"B": 1, "H": 5, "S": 307, "D": 64, "causal": True}  # the GPU sweep's random-large-seed20261207009


def _attention(bm: int, bn: int, threads: int):
    config = {"BM": bm, "BN": bn, "STAGES": 2, "DG": 1, "threads": threads}
    return specialize(ATTENTION.kernel, ATTENTION.kernel.bind(ATTENTION.meta_inputs(SWEEP_CASE)), "sm100", config,
                      ATTENTION.constants_of(SWEEP_CASE))


def test_a_reduced_64_row_accumulator_of_24_columns_a_group_is_refused_at_its_gemm_line():
    """Attention reduces its scores along their rows: 64 x 192 over four warp groups (24 columns
    each) fails in TileLang's row reduction, which a gemm alone does not meet (kept above)."""
    with pytest.raises(UnsupportedError, match=r"flash_attention\.py:\d+.*64 x 192 accumulator over 4 warp groups "
                                               r"\(24 columns each, fewer than 32 and not a power of two"):
        _attention(64, 192, 512)


@pytest.mark.parametrize("bm, bn, threads", [(64, 192, 128), (128, 192, 512), (64, 128, 512), (64, 64, 512)])
def test_the_reduced_drains_tilelang_lays_out_are_kept(bm, bn, threads):
    _attention(bm, bn, threads)  # each lowered through TileLang on 2026-12-08


@pytest.mark.slow
def test_the_sweeps_attention_case_on_sm100_lowers_through_tilelang(tmp_path):
    """Where the cost model chose 64 x 192 at 512 threads, the config a user gets now lowers."""
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import generate_case
    from duotile.codegen.tilelang_cuda import toolchain

    (art,) = generate_case(ATTENTION, SWEEP_CASE, "sm100")
    path = tmp_path / "kernel_tilelang.py"
    path.write_text(art.stages["tilelang"])
    prim, configs = toolchain.load_generated(str(path), art.meta["entry"])
    cuda, report = toolchain.lower_checked(prim, "sm_100a", configs)
    assert "tcgen05" in cuda and report.unproven == []
