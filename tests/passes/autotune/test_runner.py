import json
import time

import pytest
import torch

from duotile.codegen.target import get_target
from duotile.passes.autotune import report
from duotile.passes.autotune.cache import best_config
from duotile.passes.autotune.runner import Runner
from duotile.passes.autotune.tuner import tune

from .kernels import COL_SUM_SPEC, SCALE_SPEC

CASE = {"N": 16, "D": 8}
GOOD = {"BN": 4, "SKIP": False, "MODE": "plain"}


def test_runner_records_compile_fail_wrong_and_ok_and_goes_on():
    runner = Runner(SCALE_SPEC, CASE, "interpret", reps=2, warmup=1, workers=2)
    trials = runner.evaluate([{**GOOD, "MODE": "broken"}, {**GOOD, "SKIP": True}, GOOD])
    assert [t.status for t in trials] == ["compile_error", "wrong", "ok"]
    assert "tile of shape" in trials[0].reason or "broadcast" in trials[0].reason
    assert "elements off" in trials[1].reason  # half the rows were never written (NaN-poisoned)
    assert trials[2].time_ms > 0 and trials[2].max_error == 0.0
    assert trials[1].time_ms is None  # a wrong candidate's time never counts


def test_a_wrong_reference_fails_every_candidate(monkeypatch):
    runner = Runner(SCALE_SPEC, CASE, "interpret", reps=1, warmup=0)
    monkeypatch.setattr(runner, "_expected", {"y": torch.zeros(16, 8)})
    assert [t.status for t in runner.evaluate([GOOD])] == ["wrong"]


def test_timeout_is_recorded_and_the_sweep_continues(monkeypatch):
    target = get_target("interpret")
    real_load = target.load

    def slow_load(artifact, module):
        fn = real_load(artifact, module)
        if module.config.get("BN") == 8:
            return lambda tensors: (time.sleep(1.0), fn(tensors))
        return fn

    monkeypatch.setattr(target, "load", slow_load)
    runner = Runner(SCALE_SPEC, CASE, "interpret", reps=1, warmup=0, run_timeout=0.3)
    trials = runner.evaluate([{**GOOD, "BN": 8}, GOOD])
    assert [t.status for t in trials] == ["timeout", "ok"]
    assert "ran past 0.3 s" in trials[0].reason


def test_tune_end_to_end_on_the_interpreter(tmp_path):
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", strategy="exhaustive", cache_dir=tmp_path,
                  progress=False, runner_options={"reps": 1, "warmup": 0, "workers": 2})
    counts = result.counts()
    assert result.space_size == 18
    # "broken" configs do not trace: the constraints prune them before anything is compiled
    assert counts["pruned"] == 6 and counts["wrong"] == 6 and counts["ok"] == 6
    assert all("does not trace" in t.reason for t in result.trials if t.status == "pruned")
    assert not result.best.config["SKIP"] and result.best.config["MODE"] != "broken"
    assert result.default.is_default and result.default.status == "ok"
    sig = SCALE_SPEC.kernel.bind(SCALE_SPEC.make_inputs(CASE, "cpu", 0))
    assert best_config(SCALE_SPEC.kernel, "interpret", sig.shapes, result.device, cache_dir=tmp_path,
                       dtypes=sig.dtypes, present=sig.present) == result.best.config
    data = json.loads((tmp_path / "tuning.json").read_text())
    (entry,) = data["entries"].values()
    assert entry["config"] == result.best.config and entry["metric"] == "measured"
    text = report.summary(result)
    assert "speed-up over default" in text and "wrong" in text
    js = report.write_json(result, tmp_path / "r.json")
    assert json.loads(js.read_text())["counts"] == counts
    png = report.plot(result, tmp_path / "r.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_tune_rejects_a_batch_dependent_reduction_before_compiling_anything(tmp_path, monkeypatch):

    from duotile.dsl.errors import DslError
    from duotile.passes.autotune import runner

    def no_build(*args, **kwargs):
        raise AssertionError("a candidate was compiled")

    monkeypatch.setattr(runner, "specialize_phases", no_build)
    with pytest.raises(DslError, match="batch-invariant in T, but tunable 'BT'"):
        tune(COL_SUM_SPEC, {"T": 16, "D": 8}, "interpret", budget="quick", cache_dir=tmp_path, progress=False)


def test_tune_notes_that_a_batch_invariant_kernel_was_checked(tmp_path):
    from duotile.kernels_spec import registry

    result = tune(registry.get("rmsnorm"), {"T": 3, "D": 64}, "interpret", budget="quick",
                  pins={"ROWS": 2, "ALIGN": 1024}, cache_dir=tmp_path, progress=False,
                  runner_options={"reps": 1, "warmup": 0})
    assert result.best.config == {"ROWS": 2, "ALIGN": 1024}
    assert any(n.startswith("batch-invariant in T: reductions checked") for n in result.notes)


def test_cli_tune_writes_report_plot_and_cache(tmp_path, capsys):
    from duotile.cli import main

    rc = main(["tune", "rmsnorm", "--target", "interpret", "--shape", "T=3", "--shape", "D=64",
               "--budget", "quick", "--pin", "ROWS=2", "--pin", "ALIGN=1024", "--out", str(tmp_path / "out"),
               "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "best config" in out and "ROWS=2" in out
    assert (tmp_path / "out" / "rmsnorm_interpret.png").exists()
    from duotile.kernels_spec import registry

    k = registry.get("rmsnorm").kernel
    # batch-invariant: the config tuned at T=3 serves any T
    import torch as _t

    sig = k.bind({"x": _t.empty(1000, 64, dtype=_t.bfloat16), "weight": _t.empty(64, dtype=_t.bfloat16),
                  "y": _t.empty(1000, 64, dtype=_t.bfloat16)})
    cfg = best_config(k, "interpret", sig.shapes, "model:interpret", dtypes=sig.dtypes, present=sig.present,
                      cache_dir=tmp_path / "cache")
    assert cfg == {"ROWS": 2, "ALIGN": 1024}


def test_cuda_target_runner_builds_without_a_gpu():
    """Regression: giving the CUDA device an index must not touch CUDA on a CPU-only machine."""
    import torch

    from duotile.kernels_spec import get
    from duotile.passes.autotune.runner import Runner

    if torch.cuda.is_available():
        return
    runner = Runner(get("rmsnorm"), {"T": 4, "D": 64}, "sm100", measure=False)
    assert runner.device.type == "cuda" and runner.device.index is None
    (trial,) = runner.evaluate([{"ROWS": 1, "threads": 128, "raster": 0}])
    assert trial.status == "compiled", trial.reason
    assert trial.build["spill_stores"] == 0 and trial.build["registers"] > 0  # ptxas's report travels along
    assert trial.to_json()["build"] == trial.build


def test_finalists_are_retimed_side_by_side_and_the_confirmed_best_wins(tmp_path, monkeypatch):
    """A candidate that was lucky in its single sweep timing loses once the finalists are re-timed
    together: the best is chosen by the confirmed (median of alternating rounds) time."""
    calls = []

    def retime(self, configs, rounds=3):
        calls.append((len(configs), rounds))
        # the search's fastest finalist turns out slowest when timed beside the others
        return [[10.0 + i] * rounds if i == 0 else [1.0 + i] * rounds for i in range(len(configs))]

    monkeypatch.setattr(Runner, "retime", retime)
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", strategy="exhaustive", cache_dir=tmp_path,
                  progress=False, runner_options={"reps": 1, "warmup": 0, "workers": 2})
    finalists = [t for t in result.trials if t.confirmed_ms is not None]
    assert calls and calls[0][1] == 3 and len(finalists) == calls[0][0] >= 3
    fastest_in_search = min((t for t in result.trials if t.counts), key=lambda t: t.time_ms)
    assert fastest_in_search.confirmed_ms == 10.0 and result.best is not fastest_in_search
    assert result.best.confirmed_ms == 2.0 and result.best.final_ms == 2.0
    assert any("re-timing" in n for n in result.notes)


def test_retime_runs_real_candidates_on_the_interpreter():
    runner = Runner(SCALE_SPEC, CASE, "interpret", reps=1, warmup=0, workers=1)
    ok = [GOOD, {**GOOD, "BN": 2}]
    assert [t.status for t in runner.evaluate(ok)] == ["ok", "ok"]
    times = runner.retime(ok, rounds=2)
    assert len(times) == 2 and all(len(ts) == 2 and all(x > 0 for x in ts) for ts in times)


def test_retime_reuses_the_kernels_the_sweep_loaded(monkeypatch):
    """Loading JIT-compiles on a GPU: finalists measured by this runner are not loaded again."""
    runner = Runner(SCALE_SPEC, CASE, "interpret", reps=1, warmup=0, workers=1)
    loads = []
    real = runner.target.load
    monkeypatch.setattr(runner.target, "load", lambda a, m: loads.append(1) or real(a, m))
    configs = [GOOD, {**GOOD, "BN": 2}]
    runner.evaluate(configs)
    assert len(loads) == 2
    runner.retime(configs, rounds=2)
    assert len(loads) == 2
    runner.retime([{**GOOD, "BN": 8}], rounds=1)  # never measured here: built and loaded once
    assert len(loads) == 3


def test_also_try_start_points_are_measured_right_after_the_default(tmp_path):
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", strategy="pattern", cache_dir=tmp_path,
                  progress=False, runner_options={"reps": 1, "warmup": 0, "workers": 1},
                  also_try=[{"BN": "8"}, {"BN": 4}, {"BN": 2}], finalists=0)
    measured = [t for t in result.trials if t.status != "pruned"]
    assert measured[0].is_default
    # "8" (command-line text) is parsed; {"BN": 2} is the default, measured once
    assert [t.config["BN"] for t in measured[:3]] == [2, 8, 4]
    keys = [tuple(sorted(t.config.items())) for t in result.trials]
    assert len(keys) == len(set(keys))  # nothing measured twice


def test_also_try_names_a_bad_start_point(tmp_path):

    with pytest.raises(ValueError, match="'NOPE' is not a tunable"):
        tune(SCALE_SPEC, CASE, "interpret", budget="quick", cache_dir=tmp_path, progress=False,
             also_try=[{"NOPE": 1}])
    with pytest.raises(ValueError, match="BN=3 is not one of"):
        tune(SCALE_SPEC, CASE, "interpret", budget="quick", cache_dir=tmp_path, progress=False,
             also_try=[{"BN": 3}])


def _hanging_load(monkeypatch, seconds: float):
    """Configs with BN=8 sleep ``seconds`` in their run: a kernel that outlives its timeout."""
    target = get_target("interpret")
    real_load = target.load

    def load(artifact, module):
        fn = real_load(artifact, module)
        if module.config.get("BN") == 8:
            return lambda tensors: (time.sleep(seconds), fn(tensors))
        return fn

    monkeypatch.setattr(target, "load", load)


def test_a_device_still_running_a_timed_out_kernel_refuses_further_runs(monkeypatch):
    # regression: on the H200 a deadlocked candidate stalled a sweep; every later candidate then
    # waited its full timeout behind it on the GPU stream
    _hanging_load(monkeypatch, 3.0)
    runner = Runner(SCALE_SPEC, CASE, "interpret", reps=1, warmup=0, run_timeout=0.3, serial_device=True)
    t0 = time.monotonic()
    trials = runner.evaluate([{**GOOD, "BN": 8}, GOOD, {**GOOD, "BN": 2}])
    assert [t.status for t in trials] == ["timeout", "timeout", "timeout"]
    assert "first run ran past 0.3 s" in trials[0].reason
    assert trials[1].reason.startswith("not run: the device is still busy") and runner.stuck
    assert time.monotonic() - t0 < 2.0  # one grace period, not one timeout a candidate


def test_a_runaway_that_ends_in_its_grace_period_frees_the_device(monkeypatch):
    _hanging_load(monkeypatch, 0.5)
    runner = Runner(SCALE_SPEC, CASE, "interpret", reps=1, warmup=0, run_timeout=0.3, serial_device=True)
    trials = runner.evaluate([{**GOOD, "BN": 8}, GOOD])
    assert [t.status for t in trials] == ["timeout", "ok"] and runner.stuck is None


def test_tune_stops_and_reports_when_a_candidate_hangs_the_device(tmp_path, monkeypatch):
    _hanging_load(monkeypatch, 5.0)
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", strategy="pattern", cache_dir=tmp_path,
                  progress=False, also_try=[{"BN": 8}],
                  runner_options={"reps": 1, "warmup": 0, "workers": 1, "run_timeout": 0.3, "serial_device": True})
    assert any(n.startswith("sweep stopped: the device is still busy") for n in result.notes)
    measured = [t for t in result.trials if t.status != "pruned"]
    assert [t.status for t in measured[:2]] == ["ok", "timeout"]  # the default, then the hang
    assert result.best is not None and result.best.is_default  # what was measured before still counts
    # the batch already compiled is refused at once; then the search stops (no more batches)
    assert all(t.reason.startswith("not run: the device") for t in measured[2:])
    assert len(measured) <= 2 + 8


def test_cli_also_try_parses_start_points_from_text(tmp_path, capsys):
    from duotile.cli import main

    rc = main(["tune", "rmsnorm", "--target", "interpret", "--shape", "T=3", "--shape", "D=64", "--budget", "quick",
               "--strategy", "pattern", "--also-try", "ROWS=4", "--out", str(tmp_path / "out"),
               "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
    assert rc == 0
    report = json.loads((tmp_path / "out" / "rmsnorm_interpret.json").read_text())
    measured = [t for t in report["trials"] if t["status"] != "pruned"]
    assert measured[1]["config"]["ROWS"] == 4  # right after the default, as an int
    rc = main(["tune", "rmsnorm", "--target", "interpret", "--shape", "T=3", "--shape", "D=64", "--budget", "quick",
               "--also-try", "ROWS=3", "--out", str(tmp_path / "o2"), "--no-cache", "--no-progress"])
    assert rc == 2 and "also_try: ROWS='3' is not one of [1, 2, 4, 8]" in capsys.readouterr().err


def test_the_targets_start_points_are_measured_before_the_users(tmp_path, monkeypatch):
    target = get_target("interpret")
    monkeypatch.setattr(target, "start_points", lambda module: [{"BN": 8}], raising=False)
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", strategy="pattern", cache_dir=tmp_path,
                  progress=False, runner_options={"reps": 1, "warmup": 0, "workers": 1},
                  also_try=[{"BN": 4}], finalists=0)
    measured = [t for t in result.trials if t.status != "pruned"]
    assert [t.config["BN"] for t in measured[:3]] == [2, 8, 4]


def test_a_hang_in_the_confirm_phase_keeps_the_sweeps_results(tmp_path, monkeypatch):
    def stuck_retime(self, configs, rounds=3):
        raise TimeoutError("ran past 0.3 s")

    monkeypatch.setattr(Runner, "retime", stuck_retime)
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", strategy="exhaustive", cache_dir=tmp_path,
                  progress=False, runner_options={"reps": 1, "warmup": 0, "workers": 1})
    assert result.best is not None and result.best.confirmed_ms is None
    assert any(n.startswith("confirm phase stopped (ran past 0.3 s)") for n in result.notes)
    assert (tmp_path / "tuning.json").exists()  # the best of the sweep is still remembered


def test_start_points_the_quick_estimate_would_prune_are_measured_if_a_build_accepts_them(tmp_path, monkeypatch):
    """Regression: the H200 attention sweep never measured its own default (128x192 blocks): the
    register estimate pruned it, though it builds without spills and was the fastest measured. The
    default and the start points are now measured unless a build would refuse them; the estimate
    still filters what the search proposes."""
    import sympy

    from duotile.codegen.target import get_target
    from duotile.dsl.ir import Role
    from duotile.passes.autotune.usage import Limit

    target = get_target("interpret")

    def tight(usage, knobs):  # an estimate that calls every tile above 2 rows too big
        return [Limit("registers (test)", sympy.Integer(usage.peak[Role.VECTOR]), sympy.Integer(2 * 8 * 4))]

    monkeypatch.setattr(target, "tuning_limits", tight)
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", strategy="pattern", cache_dir=tmp_path,
                  progress=False, runner_options={"reps": 1, "warmup": 0, "workers": 1},
                  also_try=[{"BN": 8}, {"MODE": "broken"}], finalists=0)
    start = next(t for t in result.trials if t.config == {**GOOD, "BN": 8})
    assert start.status == "ok"  # a start point: measured despite the estimate
    assert any("BN=8" in n and "quick estimate" in n for n in result.notes)
    searched = [t for t in result.trials if t.config["BN"] == 4]
    assert searched and all(t.status == "pruned" for t in searched)  # the search still filters
    broken = next(t for t in result.trials if t.config == {"BN": 2, "SKIP": False, "MODE": "broken"})
    assert broken.status == "pruned"  # a build would refuse it: not measured


def test_under_a_cost_model_a_spilling_candidate_loses_to_one_that_does_not():
    from duotile.passes.autotune.runner import Trial
    from duotile.passes.autotune.tuner import _pick

    spills = Trial({"BN": 2}, "compiled", time_ms=1.0, metric="model", build={"spill_stores": 340})
    clean = Trial({"BN": 4}, "compiled", time_ms=1.2, metric="model", build={"spill_stores": 0})
    notes: list[str] = []
    assert _pick([spills, clean], True, notes) is clean and "spills registers" in notes[0]
    assert _pick([spills, clean], False, []) is spills  # measured: the time already counts the spill
    assert _pick([spills], True, []) is spills and _pick([], True, []) is None


def test_a_spec_whose_reference_runs_in_parts_is_tuned(tmp_path):
    """Regression: the runner handed the reference the inputs without the outputs, and attention's
    reference, run one (batch, head) at a time, takes its parts' shapes from the output: every
    flash_attention candidate of a model sweep failed with KeyError 'o'."""
    from duotile.kernels_spec import registry

    spec = registry.get("flash_attention")
    assert spec.reference_parts
    result = tune(spec, {"B": 1, "H": 2, "S": 64, "D": 32}, "interpret", budget="shortlist", cache_dir=tmp_path,
                  progress=False, also_try=[{"BN": 32}], start_points=False)
    assert [t.status for t in result.trials] == ["ok", "ok"] and result.best is not None


def test_a_spec_of_two_phases_tunes():
    """gemm_blockscaled's K split runs two launches; the tuner's knob filter read the traced
    module's one grid and every sweep of it failed ("has 2 phases") before building anything."""
    from duotile.kernels_spec import registry

    spec = registry.get("gemm_blockscaled")
    pins = {"BM": 64, "BN": 64, "BK": 128, "STAGES": 2, "SPLIT": 2, "threads": 128, "raster": 0}
    result = tune(spec, spec.cases["v4_ragged"], "sm100", budget="quick", strategy="exhaustive", pins=pins,
                  write_cache=False, progress=False, start_points=False)
    assert result.best.status == "compiled" and result.best.config["SPLIT"] == 2
