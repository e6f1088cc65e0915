"""``duotile tune --model``: one sweep per shape bucket of a model's shapes, at its largest shape."""

from __future__ import annotations

from duotile.kernels_spec.registry import get
from duotile.passes.autotune import model_sweep


def test_plan_groups_shapes_by_bucket_and_tunes_the_largest():
    spec = get("rmsnorm")  # T is dynamic and the batch: only the width keys a bucket
    runs = model_sweep.plan(spec, "v41-flash")
    widths = sorted(r.bucket["D"] for r in runs)
    assert widths == sorted({1 << (c["D"] - 1).bit_length() for c in spec.model_cases("v41-flash").values()})
    assert sum(len(r.serves) for r in runs) == len(spec.model_cases("v41-flash"))
    for r in runs:
        assert spec.model_cases()[r.shape]["T"] == max(spec.model_cases()[s]["T"] for s in r.serves)


def test_gemm_buckets_keep_the_token_count():
    spec = get("gemm")  # M is bucketed: decode rows and prefill chunks tune apart
    runs = model_sweep.plan(spec, "v4-flash")
    assert {r.bucket["M"] for r in runs} == {1, 16, 64, 4096}


def test_cli_sweeps_a_model_and_prints_one_table(tmp_path, capsys, monkeypatch):
    """The command's glue, with each sweep stood in for (a real one is minutes a shape)."""
    from types import SimpleNamespace

    from duotile.cli import main
    from duotile.passes.autotune import tuner

    asked = []

    def fake_tune(spec, case, target, **kw):
        asked.append((case["D"], kw["budget"], kw["cache_dir"]))
        best = SimpleNamespace(config={"ROWS": 1}, final_ms=0.01)
        return SimpleNamespace(best=best, default=SimpleNamespace(final_ms=0.02, counts=1), speedup=2.0)

    monkeypatch.setattr(tuner, "tune", fake_tune)
    code = main(["tune", "rmsnorm", "--model", "v4-flash", "--target", "sm100", "--no-progress",
                 "--cache-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "shape buckets tuned" in out and "ROWS=1" in out and "2.000x" in out
    assert len(asked) == len(model_sweep.plan(get("rmsnorm"), "v4-flash"))
    assert all(budget == "quick" and where == str(tmp_path) for _, budget, where in asked)


def test_shape_patterns_pick_some_of_a_models_shapes():
    spec = get("gemm")
    runs = model_sweep.plan(spec, "v41-flash", ["*/prefill*"])
    assert runs and all(r.bucket["M"] == 4096 for r in runs)
    assert {r.shape for r in model_sweep.plan(spec, "v41-flash", ["v41/wq_b/*"])} == {
        f"v41/wq_b/{p}" for p in ("decode1", "decode16", "decode64", "prefill4096")}
    assert model_sweep.plan(spec, "v41-flash", ["no/such/*"]) == []


def test_a_shortlist_sweep_builds_every_bucket_first_then_measures_each_list(monkeypatch, capsys):
    """--budget shortlist: each bucket's list (fixed before measuring) is built for all buckets at
    once, then each bucket measures exactly its list, without the target's own start points."""
    from types import SimpleNamespace

    from duotile.passes.autotune import shortlist, tuner

    spec, built, measured = get("gemm"), [], []
    monkeypatch.setattr(shortlist, "shortlist", lambda spec, case, target: [{"BN": case["N"] % 7}, {"BN": 1}])
    monkeypatch.setattr(model_sweep, "prebuild_configs", lambda spec, jobs, target, n: built.extend(jobs) or [])

    def fake_tune(spec, case, target, **kw):
        assert built, "measured before the builds"
        measured.append((case["N"], kw["also_try"], kw["start_points"], kw["budget"]))
        return SimpleNamespace(best=None, default=None, speedup=None)

    monkeypatch.setattr(tuner, "tune", fake_tune)
    runs = model_sweep.sweep(spec, "v41-flash", "sm90", budget="shortlist", shapes=["*/prefill*"], jobs=4,
                             progress=False)
    assert len(built) == 2 * len(runs) == 2 * len(measured)
    assert all(also == [{"BN": n % 7}, {"BN": 1}] and not own and b == "shortlist" for n, also, own, b in measured)
    assert capsys.readouterr().out.count("[") >= len(runs)


def test_shortlist_holds_the_users_config_the_default_and_the_measured_schedule():
    """gemm at a V4.1 prefill shape: the config a user gets, the defaults, the shipped 8192^3 entry
    (a measured schedule) and the cost model's tiles under that entry's knobs; every one accepted."""
    from duotile.codegen.choose_config import explain_choice, nearest_shipped
    from duotile.passes.autotune.constraints import Constraints
    from duotile.passes.autotune.shortlist import shortlist
    from duotile.passes.autotune.space import config_key

    spec = get("gemm")
    case = spec.model_cases()["v41/wq_b/prefill4096"]
    got = shortlist(spec, case, "sm90")
    sig = spec.kernel.bind(spec.meta_inputs(case))
    chosen = explain_choice(spec.kernel, "sm90", sig, spec.constants_of(case))[0]
    entry = nearest_shipped(spec.kernel, "sm90", sig, max_octaves=float("inf"))
    assert entry is not None and 4 <= len(got) <= 8 and len({config_key(c) for c in got}) == len(got)
    assert all(chosen.items() <= c.items() for c in got[:1]) and any(entry.items() <= c.items() for c in got)
    knobs = {k: v for k, v in entry.items() if k not in spec.kernel.tunables}
    assert sum(knobs.items() <= c.items() for c in got) >= 3  # the entry and the model's tiles under its schedule
    cons = Constraints(spec.kernel, sig, "sm90")
    assert all(cons.check(c).ok for c in got)


def test_shortlist_fills_the_sms_where_the_models_best_tiles_leave_them_idle():
    """V4's router at a prefill chunk (N = 256): the 128 x 128 tiles the model ranked best run 64
    programs on 132 SMs (0.55x torch on the H200); ``wave_filling`` proposes configs within two
    tunables of them that fill the machine, one keeping the one launch. Where the best tiles fill it
    (V4.1's wq_b), it proposes none."""
    from duotile.codegen.target import get_target
    from duotile.passes.autotune.constraints import Constraints
    from duotile.passes.autotune.cost_model import estimate_phases
    from duotile.passes.autotune.shortlist import FILL, wave_filling
    from duotile.passes.autotune.space import ConfigSpace

    spec = get("gemm")
    machine = get_target("sm90").machine
    space = ConfigSpace.from_kernel(spec.kernel, get_target("sm90"))

    def sig_of(shape):
        return spec.kernel.bind(spec.meta_inputs(spec.model_cases()[shape]))

    def programs(sig, c):
        v = Constraints(spec.kernel, sig, "sm90").check(c, full=False)
        return estimate_phases(v.phases, machine).programs, len(v.phases)

    router = sig_of("v4/router/prefill4096")
    best = {**space.default(), "BM": 128, "BN": 128, "BK": 64, "STAGES": 3, "SPLIT": 1}
    assert programs(router, best) == (64, 1)
    filled = [programs(router, c) for c in wave_filling(spec.kernel, "sm90", router, None, space, best, 2)]
    assert filled and all(n >= FILL * machine.units for n, _ in filled) and (filled[0][1] == 1)

    wq_b = sig_of("v41/wq_b/prefill4096")
    wide = {**best, "BN": 256}
    assert programs(wq_b, wide)[0] >= machine.units
    assert wave_filling(spec.kernel, "sm90", wq_b, None, space, wide, 2) == []


def test_a_small_space_of_tunables_is_shortlisted_whole():
    """rmsnorm's rows a block and tile alignment (4 x 3 configs) at V4.1's mHC width: every pair at
    each of the target's thread counts is on the list, the user's config first, the ones the cost
    model's register estimate would prune included (20,480 wide at 128 threads was the fastest
    measured on the H200, 2026-12-04)."""
    from duotile.codegen.choose_config import explain_choice
    from duotile.passes.autotune.constraints import Constraints
    from duotile.passes.autotune.shortlist import WHOLE, shortlist

    spec = get("rmsnorm")
    case = spec.model_cases()["v41/mhc/prefill4096"]
    got = shortlist(spec, case, "sm90")
    sig = spec.kernel.bind(spec.meta_inputs(case))
    chosen = explain_choice(spec.kernel, "sm90", sig, spec.constants_of(case))[0] or {}
    tun = spec.kernel.tunables
    want = {(r, a, t) for r in tun["ROWS"].values() for a in tun["ALIGN"].values() for t in (128, 256, 512)}
    assert len(want) <= WHOLE and {(c["ROWS"], c["ALIGN"], c["threads"]) for c in got} == want
    assert chosen.items() <= got[0].items()
    cons = Constraints(spec.kernel, sig, "sm90")
    assert not cons.check({**got[0], "ROWS": 1, "ALIGN": 2048, "threads": 128}).ok  # the estimate's prune


def test_a_router_is_shortlisted_at_every_thread_count_one_warp_included():
    """The router's ROWS (4 values) times all five sm90 thread counts fit the whole list (20 configs):
    its chain of row reductions is shuffles alone on one warp (codegen/tilelang_cuda/target.py)."""
    from duotile.passes.autotune.shortlist import shortlist

    spec = get("router")
    got = shortlist(spec, spec.model_cases()["v41/e384_top6/decode1"], "sm90")
    want = {(r, t) for r in spec.kernel.tunables["ROWS"].values() for t in (32, 64, 128, 256, 512)}
    assert want <= {(c["ROWS"], c["threads"]) for c in got}


def test_no_whole_space_for_a_gemm_or_a_large_space():
    from duotile.passes.autotune.shortlist import whole_space
    from duotile.passes.autotune.space import ConfigSpace

    spec = get("gemm")
    space = ConfigSpace.from_kernel(spec.kernel, "sm90")
    assert whole_space(space, space.default()) == []
    case = spec.model_cases()["v41/wq_b/prefill4096"]
    from duotile.passes.autotune.shortlist import shortlist

    assert len(shortlist(spec, case, "sm90")) <= 8
    small = get("flash_attention")  # a gemm: ranked by the model, whatever its space's size
    assert len(shortlist(small, next(iter(small.model_cases().values())), "sm90")) <= 8
