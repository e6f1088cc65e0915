"""The sm90 ``cluster`` knob: persistent blocks in pairs that share a gemm's B tile by TMA multicast
(persistent.py, manual_ws.py). Built and inspected here; results on the H200 are in
tests/gpu/test_sm90_knobs.py."""

from __future__ import annotations

import re

import pytest

from duotile.codegen.compile import specialize
from duotile.codegen.driver import build_case
from duotile.dsl.errors import UnsupportedError
from duotile.kernels_spec import load_all

FP8_WIDE = {"BM": 128, "BN": 256, "BK": 128, "STAGES": 4, "fp8_promote_k": 0, "warp_specialize": "manual",
            "persistent": True, "raster": 16}


def test_cluster_multicasts_the_shared_tile_and_frees_it_in_both_blocks():
    spec = load_all()["gemm"]
    case = spec.build_cases["fp8_8192"]
    r = build_case(spec, "fp8_8192", case, "sm90", config={**FP8_WIDE, "cluster": 2}, use_tuned=False)
    assert r.ok, r.error
    text, ptx = r.artifact.stages["tilelang"], r.artifact.stages["ptx"]
    # 66 clusters of two walk 1024 pairs of 128-row tiles; a block's rows: its rank in the pair
    assert "T.ClusterKernel(132, cluster_dims=2, threads=384)" in text
    assert "m = (panel_row + T.truncmod(in_panel, panel_rows)) * 2 + cta % 2" in text
    # B (256 x 128, free of m) is multicast, A (each block's own rows) is not
    loads = [line for line in text.splitlines() if "T.tma_copy(" in line]
    assert [("cluster_mask=0b11" in line, line.split("(")[1][0]) for line in loads] == [(False, "a"), (True, "b")]
    assert "b1_smem_empty = T.alloc_cluster_barrier([16] * 4)" in text  # 8 consumer warps x 2 blocks
    assert text.count("T.mbarrier_arrive(b1_smem_empty[") == 4  # to rank 0 and rank 1, in loop and after
    assert text.rstrip().endswith("T.cluster_sync()  # no block exits while its pair may still multicast into it")
    multicast = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier::complete_tx::bytes" \
                r"\.multicast::cluster"
    assert re.search(multicast, ptx)
    assert "mapa" in ptx  # the remote arrive on the pair's barrier
    assert r.artifact.meta["ptxas"]["spill_stores"] == 0


def test_cluster_1_is_the_persistent_grid_unchanged():
    spec = load_all()["gemm"]
    case = spec.build_cases["fp8_8192"]
    plain = build_case(spec, "fp8_8192", case, "sm90", config=FP8_WIDE, use_tuned=False)
    one = build_case(spec, "fp8_8192", case, "sm90", config={**FP8_WIDE, "cluster": 1}, use_tuned=False)
    assert plain.ok and one.ok
    assert plain.artifact.stages["tilelang"] == one.artifact.stages["tilelang"]
    assert "Cluster" not in one.artifact.stages["tilelang"]


def test_attention_pairs_query_blocks_and_multicasts_k_and_v():
    """Attention's K and V name the batch and head, not the query block: clusters pair query
    blocks (the innermost grid axis) and multicast both; each block loads its own Q."""
    spec = load_all()["flash_attention"]
    case = spec.build_cases["d128"]
    manual = {"warp_specialize": "manual", "overlap": True, "persistent": True, "BN": 192}
    r = build_case(spec, "d128", case, "sm90", config={**manual, "cluster": 2})
    assert r.ok, r.error
    text = r.artifact.stages["tilelang"]
    assert "m = (tile_id % 16) * 2 + cta % 2" in text  # 32 query blocks: 16 pairs a head
    loads = [line.split("T.tma_copy(")[1][0] + ("*" if "cluster_mask=0b11" in line else "")
             for line in text.splitlines() if "T.tma_copy(" in line]
    assert set(loads) == {"q", "k*", "v*"}
    assert "q0_smem_empty = T.alloc_barrier(256)" in text and "v2_smem_empty = T.alloc_cluster_barrier(" in text
    assert r.artifact.meta["ptxas"]["spill_stores"] == 0


def test_clusters_pair_the_axis_whose_pairs_share_more_bytes():
    """A 128x64 gemm tile reads a 128-row A and a 64-row B a step: pairs along N share A."""
    from duotile.codegen.tilelang_cuda.persistent import pair_axis

    spec = load_all()["gemm"]
    sig = spec.kernel.bind(spec.meta_inputs({"M": 256, "N": 256, "K": 256}))
    wide = specialize(spec.kernel, sig, "sm90", {"BM": 128, "BN": 256})[0]
    tall = specialize(spec.kernel, sig, "sm90", {"BM": 128, "BN": 64})[0]
    assert (pair_axis(wide.grid), pair_axis(tall.grid)) == (-2, -1)
    cfg = {"BM": 128, "BN": 64, "warp_specialize": "manual", "persistent": True, "cluster": 2}
    r = build_case(spec, "x", {"M": 256, "N": 256, "K": 256}, "sm90", config=cfg, use_tuned=False)
    assert r.ok, r.error
    text = r.artifact.stages["tilelang"]
    assert "n = (tile_id % 2) * 2 + cta % 2" in text
    assert [("cluster_mask=0b11" in line) for line in text.splitlines() if "T.tma_copy(" in line] == [True, False]


@pytest.mark.parametrize("name,case,config,reason", [
    ("gemm", {"M": 256, "N": 256, "K": 256}, {"warp_specialize": "manual", "cluster": 2},
     "schedule of the persistent grid"),
    ("gemm", {"M": 256, "N": 256, "K": 256}, {"warp_specialize": "manual", "persistent": 3, "cluster": 2},
     r"even block count \(persistent=3\)"),
    ("gemm", {"M": 384, "N": 256, "K": 256}, {"warp_specialize": "manual", "persistent": True, "BM": 128, "cluster": 2},
     r"even extent on the grid axis it pairs \(m: 3\)"),
    ("flash_attention", {"B": 1, "H": 2, "S": 256, "D": 64, "causal": True},
     {"warp_specialize": "manual", "persistent": True, "cluster": 2}, "one trip count for both blocks"),
    ("rmsnorm", {"T": 8, "D": 64}, {"persistent": True, "cluster": 2}, "none is free of a grid axis"),
])
def test_cluster_is_refused_where_it_cannot_pair_blocks_naming_the_grid_line(name, case, config, reason):
    spec = load_all()[name]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    with pytest.raises(UnsupportedError, match=rf"{name}\.py:\d+.*cluster=2 needs .*{reason}"):
        specialize(spec.kernel, sig, "sm90", config, spec.constants_of(case))
