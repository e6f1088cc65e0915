"""The sm90 ``tma_store`` knob (tma_store.py): the output tile through shared memory and a TMA
store, in chunks of whole rows that fit beside the load rings. Built and inspected here; results on
the H200 are rows of tests/gpu/test_sm90_knobs.py."""

from __future__ import annotations

import shutil

import pytest

from duotile.codegen.compile import specialize
from duotile.codegen.driver import build_case
from duotile.dsl.errors import UnsupportedError
from duotile.kernels_spec import load_all

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]
pytest.importorskip("tilelang")

FP8_WIDE = {"BM": 128, "BN": 256, "BK": 128, "STAGES": 4, "fp8_promote_k": 0, "warp_specialize": "manual",
            "persistent": True, "raster": 16, "cluster": 2}


def test_the_fp8_tile_goes_out_in_two_64_row_chunks_beside_a_four_stage_ring():
    """4 x 48 KiB of ring leaves 35 KiB: a 64 x 256 bf16 chunk (32 KiB) fits, the whole tile does not."""
    spec = load_all()["gemm"]
    r = build_case(spec, "fp8_8192", spec.build_cases["fp8_8192"], "sm90", config={**FP8_WIDE, "tma_store": True},
                   use_tuned=False)
    assert r.ok, r.error
    a = r.artifacts[0]
    text, ptx = a.stages["tilelang"], a.stages["ptx"]
    assert 't5_frag_out = T.alloc_shared((64, 256), "bfloat16")' in text
    assert [line.strip().split("  #")[0] for line in text.splitlines() if "T.tma_copy(t5_frag_out" in line] == [
        "T.tma_copy(t5_frag_out, c[128 * m:128 * m + 64, 256 * n:256 * n + 256])",
        "T.tma_copy(t5_frag_out, c[128 * m + 64:128 * m + 64 + 64, 256 * n:256 * n + 256])"]
    assert text.count("T.sync_threads(10, 256)") == 4 and text.count("T.fence_proxy_async()") == 2
    assert "T.tma_store_wait()  # no exit while the TMA engine reads the output buffer" in text
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx and "fence.proxy.async" in ptx
    assert "st.global" not in ptx  # no thread writes the output itself
    assert a.meta["ptxas"]["spill_stores"] == 0


def test_a_small_tile_goes_out_in_one_chunk_and_without_the_knob_nothing_changes():
    spec = load_all()["gemm"]
    case = spec.cases["bf16_ragged"]
    cfg = {**spec.config_of(case), "warp_specialize": "manual", "persistent": 2, "BM": 64, "BN": 64}
    on = build_case(spec, "bf16_ragged", case, "sm90", config={**cfg, "tma_store": True}, use_tuned=False)
    off = build_case(spec, "bf16_ragged", case, "sm90", config=cfg, use_tuned=False)
    assert on.ok and off.ok, (on.error, off.error)
    assert on.artifacts[0].stages["tilelang"].count("T.tma_copy(") == 3  # A, B loads and the one store
    assert "_out = T.alloc_shared((64, 64)" in on.artifacts[0].stages["tilelang"]
    assert "tma_store" not in off.artifacts[0].stages["tilelang"]


def test_tma_store_is_refused_without_the_manual_schedule_naming_the_grid_line():
    spec = load_all()["gemm"]
    sig = spec.kernel.bind(spec.meta_inputs({"M": 256, "N": 256, "K": 256}))
    with pytest.raises(UnsupportedError, match=r"gemm\.py:\d+.*tma_store needs warp_specialize=manual"):
        specialize(spec.kernel, sig, "sm90", {"warp_specialize": "auto", "tma_store": True})


def test_full_row_tiles_of_128_rows_a_warp_group_are_refused_naming_the_store_line():
    """Regression: 256 x 128 under full_row and 4 stages reached TileLang, whose layout inversion
    failed with an InternalError that named neither the kernel line nor the config."""
    spec = load_all()["gemm"]
    cfg = {"BM": 256, "BN": 128, "BK": 64, "STAGES": 4, "warp_specialize": "manual", "persistent": True,
           "full_row": True, "tma_store": True}
    r = build_case(spec, "bf16_8192", spec.build_cases["bf16_8192"], "sm90", config=cfg, use_tuned=False)
    assert not r.ok and r.error.startswith("UnsupportedError")
    store_line = next(i for i, ln in enumerate(open(spec.kernel.source_file), 1) if "dsl.store(c[" in ln)
    assert f"gemm.py:{store_line}" in r.error and "each warp group holds 128 rows" in r.error
    # the same tile split the other way still goes out in two 128-row chunks
    r = build_case(spec, "bf16_8192", spec.build_cases["bf16_8192"], "sm90", config={**cfg, "full_row": False},
                   use_tuned=False)
    assert r.ok, r.error
    assert r.artifacts[0].stages["tilelang"].count("T.tma_copy(t3_frag_out") == 2
