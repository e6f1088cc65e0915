"""The split-K decode GEMM: two phases on every target, batch-invariant and deterministic on the
interpreter, a searched split count, and knobs that only reach the phases they apply to."""

from __future__ import annotations

import shutil

import pytest
import torch

from duotile import codegen
from duotile.codegen.compile import specialize_phases
from duotile.codegen.driver import build_case
from duotile.codegen.target import get_target
from duotile.kernels_spec import get
from duotile.passes.autotune.cost_model import estimate, estimate_phases
from duotile.passes.autotune.tuner import tune

SPEC = get("gemm_splitk")
WO_B = SPEC.build_cases["wo_b_decode"]


def starting(target: str) -> dict:
    """The shipped starting config a decode call of WO_B's shape gets on ``target``."""
    from duotile.codegen.choose_config import starting_config

    return starting_config(SPEC.kernel, target, SPEC.kernel.bind(SPEC.meta_inputs(WO_B)))


def _call(a: torch.Tensor, b: torch.Tensor, config: dict) -> torch.Tensor:
    c = torch.zeros(a.shape[0], b.shape[0], dtype=torch.bfloat16)
    codegen.compile(SPEC.kernel, "interpret", config=config)(a=a, b=b, c=c)
    return c


def test_rows_are_bitwise_the_same_at_every_batch_size_and_run():
    """A row's sum runs over the same K ranges, added in the same order, whatever M is."""
    x = SPEC.make_inputs({"M": 9, "N": 80, "K": 200}, torch.device("cpu"), 0)
    cfg = {"BM": 64, "BN": 64, "BK": 32, "SPLIT": 4}
    full = _call(x["a"], x["b"], cfg)
    for m in (1, 3, 8):
        assert torch.equal(_call(x["a"][:m].contiguous(), x["b"], cfg), full[:m]), m
    assert torch.equal(_call(x["a"], x["b"], cfg), full)


def test_split_counts_agree_with_the_reference():
    case = {"M": 5, "N": 80, "K": 200}
    x = SPEC.make_inputs(case, torch.device("cpu"), 1)
    ref = SPEC.run_reference(x, case)["c"].float()
    bound = SPEC.allowed_error(case, "c", ref, x)
    for split in (1, 2, 4, 8, 16):  # 7 K blocks: 8 and 16 ranges leave some empty
        c = _call(x["a"], x["b"], {"BM": 64, "BN": 64, "BK": 32, "SPLIT": split})
        assert bool(((c.float() - ref).abs() <= bound).all()), split


def test_the_tuner_searches_the_split_count(tmp_path):
    result = tune(SPEC, {"M": 5, "N": 96, "K": 256}, "interpret", budget="quick", strategy="exhaustive",
                  cache_dir=tmp_path, progress=False, pins={"BM": 64, "BN": 64, "BK": 64, "STAGES": 2})
    assert sorted(t.config["SPLIT"] for t in result.trials) == [1, 2, 4, 8, 16]
    assert all(t.status == "ok" for t in result.trials)  # each verified against the reference
    assert any("batch-invariant in M" in n for n in result.notes)


def test_cost_model_adds_the_phases():
    sig = SPEC.kernel.bind(SPEC.meta_inputs(WO_B))
    phases, knobs = specialize_phases(SPEC.kernel, sig, "ascend950", starting("ascend950"))
    machine = get_target("ascend950").machine
    parts = [estimate(p, machine, knobs) for p in phases]
    total = estimate_phases(phases, machine, knobs)
    assert len(parts) == 2 and total.time_s == pytest.approx(sum(p.time_s for p in parts))
    assert total.programs == sum(p.programs for p in parts)
    # regression: every phase was charged every parameter's bytes, so the combine, which reads
    # 4 x 16 x 4096 partial sums and writes C, paid for reading the 64 MiB weight too
    combine = 4 * 16 * 4096 * 4 + 16 * 4096 * 2
    assert parts[1].dram_bytes == pytest.approx(combine, rel=0.05)


def test_ascend_lowers_both_phases_with_the_range_trip_count():
    """Regression: a loop starting past 0 ran ``stop`` iterations instead of ``stop - start``, and
    a grid variable in the start of a loop that clears L0C was not named yet."""
    r = build_case(SPEC, "wo_b_decode", WO_B, "ascend950")  # the starting table: 16-row cube tiles
    assert r.ok, r.error
    p0, p1 = (a.stages["tilelang"] for a in r.artifacts)
    assert "T.Pipelined(32, num_stages=3)" in p0 and "i_k = i_k_rel + 32*i_s" in p0
    assert "clear_accum=(i_k == 32*i_s)" in p0
    assert "T.gemm" not in p1 and "for i_s_1 in T.serial(4)" in p1
    assert all("no bisheng" in a.meta["binary"] for a in r.artifacts)


def test_ascend_vector_split_applies_to_the_phase_with_cube_work_only():
    sig = SPEC.kernel.bind(SPEC.meta_inputs(WO_B))
    cfg = {**starting("ascend950"), "vector_split": True}
    phases, knobs = specialize_phases(SPEC.kernel, sig, "ascend950", cfg)
    tgt = get_target("ascend950")
    assert [tgt.phase_knobs(p, knobs)["vector_split"] for p in phases] == [True, False]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_sm90_schedule_knobs_reach_the_pipelined_phase_only():
    pytest.importorskip("tilelang")
    cfg = {**starting("sm90"), "warp_specialize": "manual", "persistent": True}
    r = build_case(SPEC, "wo_b_decode", WO_B, "sm90", config=cfg)
    assert r.ok, r.error
    p0, p1 = (a.stages["tilelang"] for a in r.artifacts)
    # M is dynamic: the persistent grid takes min(SMs, tiles) blocks of the call's tile count
    assert "T.Kernel(T.min(132, 128 * T.ceildiv(n_M, 64)), threads=384)" in p0
    assert "for k in T.serial(32 * s, (32 * s + 32))" in p0
    # its outer grid axis counts a dynamic M: one linear axis (codegen/tilelang_cuda/linear_grid.py)
    assert "T.barrier_wait" not in p1 and "T.Kernel(32 * T.ceildiv(n_M, 64), threads=256) as (grid_id,)" in p1
    assert all(a.files["cubin"].endswith(".cubin") for a in r.artifacts)


def test_the_cache_key_covers_both_phases():
    """The tuning cache hashes the trace at the default config: for a kernel that branches on its
    split count, that default must be the two-phase form, or an edit to the combine would leave
    stale tuned configs trusted."""
    for name in ("gemm_splitk", "mqa_decode"):
        kernel = get(name).kernel
        assert kernel.default_config()["SPLIT"] > 1
        module = kernel.trace()
        assert len(module.body.ops) == 2 and module.workspaces, name
