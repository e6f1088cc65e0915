"""sm90's column split (plan.py): an accumulator read row-wise that has too few rows for every
warp to hold 16 is split by columns, its row reductions crossing warp groups through shared memory.
Built and inspected here; results on the H200 are rows of tests/gpu/test_sm90_knobs.py."""

from __future__ import annotations

import re
import shutil

import pytest

from duotile.codegen.driver import build_case
from duotile.kernels_spec import load_all

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")]
pytest.importorskip("tilelang")


def test_column_split_keeps_head_dim_512_decode_in_registers_on_sm90():
    """Decode MQA at head dim 512: 64 heads x 512 fp32 is 256 registers a thread over one warp
    group (ptxas spills 2.5 KiB and serialises wgmma). Over two groups split by columns, each holds
    64 x 256: the scores' row max and sum cross the groups through shared memory, P reaches the
    second gemm through shared memory, and the partial output is written from the expression
    without a second 64 x 512 fragment. Built here; its results on the H200 are a -m gpu row."""
    spec = load_all()["mqa_decode"]
    case = spec.build_cases["hca_1m"]
    wide = build_case(spec, "hca_1m", case, "sm90", config={"threads": 256}, use_tuned=False)
    assert wide.ok, wide.error
    split = wide.artifacts[0]
    text = split.stages["tilelang"]
    assert text.count("policy=T.GemmWarpPolicy.FullCol") == 2 and "FullRow" not in text
    assert re.search(r"T\.copy\((t\d+)_frag, \1_frag_smem\)", text)  # P staged for the second gemm
    assert re.search(r"part_o\[s, b, i0, i1\] = ", text)
    assert text.count('T.alloc_fragment((64, 512,), "float32")') == 1  # the accumulator only
    assert "tl::AllReduce<tl::MaxOp, 256" in split.stages["cuda"]  # across both warp groups
    assert split.meta["ptxas"]["spill_stores"] == 0 and not split.meta["ptxas"]["wgmma_serialized"]
    narrow = build_case(spec, "hca_1m", case, "sm90", config={"threads": 128}, use_tuned=False)
    assert narrow.ok and narrow.artifacts[0].meta["ptxas"]["spill_stores"] > 0

