"""Split decode at the model's CSA and window-multiple row counts, lowered by TileLang: the
ranges that hold no block keep their guard in the CUDA (TileLang dropped the loop and ran one
block unconditionally: a 0.25 relative error at 640 rows), and a range of exactly one block with
a variable start lowers (it failed TileLang's loop-bound analysis at 1,024 rows)."""

from __future__ import annotations

import dataclasses

import pytest

from duotile.codegen.driver import build_case
from duotile.kernels_spec.registry import get

pytestmark = pytest.mark.slow


def _build(rows):
    spec = get("mqa_decode")  # built for a static row count (its rows are dynamic by default)
    spec = dataclasses.replace(spec, kernel=dataclasses.replace(spec.kernel, dynamic=()))
    r = build_case(spec, f"r{rows}", {"B": 2, "H": 64, "R": rows, "D": 512}, "sm90",
                   config={"SPLIT": 16, "BN": 64, "STAGES": 1, "threads": 256}, use_tuned=False)
    assert r.ok, r.error
    return r.artifacts[0].stages["cuda"]


def test_empty_ranges_keep_their_guard_in_cuda():
    cuda = _build(640)
    guards = [line for line in cuda.splitlines() if "if (" in line and "blockIdx.x" in line]  # 2 < (5*s & 7)
    assert guards, "the guard on the range's trip count is gone from the CUDA"


def test_one_block_ranges_lower():
    assert "wgmma" in _build(1024)
