"""The tuning cache under concurrent writers, an unwritable folder, an interrupted sweep and
entries that today's code refuses."""

from __future__ import annotations

import json
import multiprocessing
import warnings
from pathlib import Path

import pytest

from duotile.codegen.driver import build_case
from duotile.kernels_spec import get, load_all
from duotile.passes.autotune import cache as tcache
from duotile.passes.autotune import runner as trunner
from duotile.passes.autotune.cache import (
    SHIPPED,
    TuningCache,
    TuningCacheError,
    best_config,
    entry_problem,
    lookup,
    make_key,
)
from duotile.passes.autotune.tuner import tune

from ..passes.autotune.kernels import SCALE_SPEC

CASE = {"N": 16, "D": 8}
TOOLS = {"tilelang": "test", "nvcc": "test"}


# -- concurrent writers ---------------------------------------------------------------------------
def _writer(path: str, worker: int, count: int, barrier, queue) -> None:
    try:
        barrier.wait(timeout=60)
        for i in range(count):
            TuningCache(path).put({"kernel": "k", "worker": worker, "i": i}, {"BN": i}, time_ms=float(i))
        queue.put(("ok", worker))
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        queue.put(("error", f"{type(err).__name__}: {err}"))


def test_four_processes_recording_at_once_lose_no_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    path, workers, count = str(tmp_path / "tuning.json"), 4, 10
    barrier, queue = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, w, count, barrier, queue)) for w in range(workers)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(r[0] == "ok" for r in results), results
    table = TuningCache(path)
    assert not table.problems
    got = {(e["key"]["worker"], e["key"]["i"]) for e in table.entries.values()}
    assert got == {(w, i) for w in range(workers) for i in range(count)}


def test_two_caches_opened_together_merge_on_save(tmp_path):
    path = tmp_path / "tuning.json"
    TuningCache(path).put({"kernel": "old"}, {"BN": 2})
    a, b = TuningCache(path), TuningCache(path)
    a.put({"kernel": "a"}, {"BN": 4})
    b.put({"kernel": "b"}, {"BN": 8})  # b never saw a's entry: it is merged, not overwritten
    del b.entries[tcache.key_hash({"kernel": "old"})]
    b.save()  # a removal is a change too
    assert {e["key"]["kernel"] for e in TuningCache(path).entries.values()} == {"a", "b"}


# -- an unwritable cache: found before the sweep ---------------------------------------------------
def test_an_unwritable_cache_fails_before_the_sweep_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    trials = []
    with pytest.raises(TuningCacheError, match="cannot write the tuning cache") as info:
        tune(SCALE_SPEC, CASE, "interpret", budget="quick", cache_dir=blocker / "cache", progress=False,
             on_trial=trials.append)
    assert not trials  # nothing was measured, so nothing was lost
    assert len(str(info.value).splitlines()) == 1 and "--no-cache" in str(info.value)
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", cache_dir=blocker / "cache", progress=False,
                  write_cache=False)
    assert result.best is not None and result.saved is None


def test_a_save_that_still_fails_keeps_the_results_and_says_why(tmp_path, monkeypatch):
    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TuningCache, "put", full_disk)
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", cache_dir=tmp_path, progress=False)
    assert result.best is not None and result.saved is None
    assert any(n.startswith("best config not saved") and "No space left" in n for n in result.notes)


def test_an_interrupted_sweep_saves_and_reports_what_it_measured(tmp_path, monkeypatch):
    evaluate, calls = trunner.Runner.evaluate, []

    def interrupted_on_the_third_batch(self, configs):
        calls.append(configs)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(self, configs)

    monkeypatch.setattr(trunner.Runner, "evaluate", interrupted_on_the_third_batch)
    result = tune(SCALE_SPEC, CASE, "interpret", budget="quick", cache_dir=tmp_path, progress=False)
    assert result.interrupted and result.best is not None
    assert any("interrupted" in n for n in result.notes)
    measured = [t for t in result.trials if t.status != "pruned"]
    assert measured and len(measured) == sum(len(c) for c in calls[:2])
    (entry,) = TuningCache(tmp_path / "tuning.json").entries.values()
    assert entry["interrupted"] is True and entry["config"] == result.best.config


# -- entries today's code refuses -------------------------------------------------------------------
def _rmsnorm_key(case, target="interpret"):
    spec = get("rmsnorm")
    sig = spec.kernel.bind(spec.meta_inputs(case))
    return spec, sig, make_key(spec.kernel, target, sig.shapes, dtypes=sig.dtypes, present=sig.present,
                               constants={})


@pytest.mark.parametrize("config, why", [({"ROWS": 3}, "ROWS=3 is not allowed"),
                                         ({"ROWS": 2, "WIDTH": 4}, "no tunable 'WIDTH'"),
                                         ({"ROWS": "2"}, "ROWS='2' is not allowed"),
                                         (["ROWS", 2], "not a table")])
def test_an_invalid_user_entry_is_skipped_for_the_shipped_one(tmp_path, config, why):
    spec, sig, key = _rmsnorm_key({"T": 8, "D": 64})
    user = TuningCache(tmp_path / "tuning.json")
    user.entries[tcache.key_hash(key)] = {"key": key, "config": config}
    user.save()
    shipped = TuningCache(tmp_path / "shipped.json")
    shipped.put(key, {"ROWS": 4})
    with pytest.warns(UserWarning, match=why):
        got = best_config(spec.kernel, "interpret", sig.shapes, dtypes=sig.dtypes, present=sig.present,
                          cache_dir=tmp_path, shipped=tmp_path / "shipped.json")
    assert got == {"ROWS": 4}
    none, skipped = lookup(spec.kernel, "interpret", sig.shapes, dtypes=sig.dtypes, present=sig.present,
                           cache_dir=tmp_path, shipped=None)
    assert none is None and len(skipped) == 1 and "\n" not in skipped[0]


def test_an_entry_over_the_targets_capacity_is_skipped():
    spec = get("gemm")
    case = {"M": 512, "N": 512, "K": 512}
    sig = spec.kernel.bind(spec.meta_inputs(case))
    too_big = {"BM": 256, "BN": 256, "BK": 128, "STAGES": 5}
    why = entry_problem(spec.kernel, "sm90", sig.shapes, too_big, sig.dtypes, sig.present, {})
    assert why is not None and why.startswith("CapacityError") and "shared" in why
    assert entry_problem(spec.kernel, "sm90", sig.shapes, {"BM": 128, "BN": 128}, sig.dtypes, sig.present) is None


def test_a_build_skips_an_invalid_tuned_entry_says_so_in_its_meta_and_uses_the_case(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    case = {"T": 8, "D": 64, "config": {"ROWS": 2}}
    spec, sig, key = _rmsnorm_key(case)
    TuningCache(tmp_path / "tuning.json").put(key, {"ROWS": 1024})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = build_case(spec, "c", case, "interpret")
    assert r.ok, r.error
    assert r.artifact.meta["config_source"] == "default" and r.module.config["ROWS"] == 2
    (line,) = r.artifact.meta["tuned_skipped"]
    assert "ROWS=1024 is not allowed" in line and str(tmp_path) in line
    assert any("ROWS=1024" in str(w.message) for w in caught)


def test_every_shipped_entry_is_valid_for_todays_code():
    entries = TuningCache(SHIPPED, read_only=True).entries.values()
    assert entries
    for entry in entries:
        key, case = entry["key"], entry["case"]
        spec = load_all()[key["kernel"]]
        sig = spec.kernel.bind(spec.meta_inputs(case))
        why = entry_problem(spec.kernel, key["target"], sig.shapes, entry["config"], sig.dtypes, sig.present,
                            spec.constants_of(case))
        assert why is None, (key["kernel"], why)


def test_a_shipped_table_from_another_version_is_reported_not_trusted(tmp_path):
    table = json.loads(Path(SHIPPED).read_text())
    entry = next(iter(table["entries"].values()))
    entry["config"]["warp_specialize"] = "bogus"  # well formed, checksum recomputed: only validation sees it
    older = TuningCache(tmp_path / "older.json")
    older.entries = table["entries"]
    older.save()
    key, case = entry["key"], entry["case"]
    spec = load_all()[key["kernel"]]
    sig = spec.kernel.bind(spec.meta_inputs(case))
    config, skipped = lookup(spec.kernel, key["target"], sig.shapes, key["device"], dtypes=sig.dtypes,
                             present=sig.present, constants=spec.constants_of(case), cache_dir=tmp_path / "none",
                             toolchain=key["toolchain"], shipped=tmp_path / "older.json")
    assert config is None
    assert len(skipped) == 1 and "warp_specialize='bogus' is not allowed" in skipped[0] and "'manual'" in skipped[0]
