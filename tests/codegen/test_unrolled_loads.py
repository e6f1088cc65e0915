"""CUDA targets emit a short loop that only loads into registers and folds them as ``T.unroll``
(``codegen/tilelang_cuda/unrolled_loads.py``).

Regression: a split reduction's combine (``for s < SPLIT: out += part_o[s] * w[s]``) was a
``T.serial`` loop that stayed a loop in the PTX, each trip's loads issued after the previous trip's
adds: one global-memory latency a range (32 at V4's HCA SPLIT 32). Unrolled,
the PTX holds every trip's loads, none behind a branch."""

from __future__ import annotations

import re

import pytest

from duotile.codegen.compile import specialize_phases
from duotile.codegen.target import get_target
from duotile.codegen.tilelang_cuda import unrolled_loads
from duotile.codegen.tilelang_cuda.plan import make_plan
from duotile.kernels_spec.registry import load_all

SPLIT = {"BN": 64, "STAGES": 2, "SPLIT": 8, "BD": 128}


def _phases(target: str, name: str, shape: str, config: dict):
    t = get_target(target)
    spec = load_all()[name]
    case = spec.model_shapes[shape]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    phases, knobs = specialize_phases(spec.kernel, sig, t, config, spec.constants_of(case))
    return t, [t.lower(p, knobs) for p in phases], knobs


def _loops(module):
    return [op for op in module.walk() if op.name == "for"]


@pytest.mark.parametrize("target", ["sm90", "sm100"])
def test_the_split_decode_combine_unrolls_and_its_block_loops_do_not(target):
    config = {**SPLIT, "DG": 2} if target == "sm100" else SPLIT  # sm100: the output as two TMEM column groups
    t, (split, combine), knobs = _phases(target, "sparse_mqa_decode_fp8", "v41/csa_r2_topk640/decode1", config)
    for module, want in ((split, False), (combine, True)):
        plan = make_plan(module, t.arch, knobs.get("threads"))
        loops = _loops(module)
        assert loops
        # the combine's two loops over the 8 ranges (their LSE maximum, then the weighted sum)
        assert [unrolled_loads.unrolls(op, plan.scope) for op in loops] == [want] * len(loops)
    source = t.generate(combine, knobs).stages["tilelang"]
    assert len(re.findall(r"for s_\d+ in T\.unroll\(0, 8\):", source)) == 2
    assert "T.serial" not in source


def test_a_loop_of_more_trips_than_the_rule_allows_stays_a_loop():
    t, (split, combine), knobs = _phases("sm90", "sparse_mqa_decode_fp8", "v41/csa_r2_topk640/decode1", SPLIT)
    plan = make_plan(combine, t.arch, knobs.get("threads"))
    loop = _loops(combine)[-1]
    assert unrolled_loads.unrolls(loop, plan.scope)
    old = loop.attrs["extent"]
    try:
        loop.attrs["extent"] = unrolled_loads.MOST_TRIPS + 1
        assert not unrolled_loads.unrolls(loop, plan.scope)
    finally:
        loop.attrs["extent"] = old


@pytest.mark.slow
def test_the_unrolled_combine_holds_every_ranges_loads_in_ptx():
    pytest.importorskip("tilelang")
    from duotile.codegen.driver import build_case

    spec = load_all()["sparse_mqa_decode_fp8"]
    case = spec.model_shapes["v41/csa_r2_topk640/decode1"]
    r = build_case(spec, "csa", case, "sm90", config=SPLIT, use_tuned=False)
    assert r.ok, r.error
    ptx = r.artifacts[1].stages["ptx"]
    # 8 ranges x a 64 x 128 FP32 tile over 256 threads: 8 x 8 four-float loads, straight-line
    assert len(re.findall(r"ld\.global\.nc\.v4\.f32", ptx)) == 64
    assert not re.search(r"@%p\d+ bra", ptx.split("ld.global.nc.v4.f32", 1)[1].rsplit("ld.global.nc.v4.f32", 1)[0])
