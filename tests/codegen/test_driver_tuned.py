"""`duotile build` takes a tuned config from the tuning cache when one matches the call."""

from __future__ import annotations

from duotile.codegen.driver import build_case
from duotile.kernels_spec import get
from duotile.passes.autotune.cache import TuningCache, cache_path, make_key


def test_build_uses_the_tuned_config_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    spec = get("rmsnorm")
    case = {"T": 8, "D": 64}
    first = build_case(spec, "c", case, "interpret")
    assert first.ok and first.artifact.meta["config_source"] == "default" and first.module.config["ROWS"] == 1
    sig = spec.kernel.bind(spec.meta_inputs(case))
    key = make_key(spec.kernel, "interpret", sig.shapes, dtypes=sig.dtypes, present=sig.present, constants={})
    cache = TuningCache(cache_path())
    cache.put(key, {"ROWS": 4})
    cache.save()
    tuned = build_case(spec, "c", case, "interpret")
    assert tuned.ok and tuned.artifact.meta["config_source"] == "tuned" and tuned.module.config["ROWS"] == 4
    pinned = build_case(spec, "c", case, "interpret", config={"ROWS": 2})
    assert pinned.module.config["ROWS"] == 2  # an explicit config wins
    assert build_case(spec, "c", case, "interpret", use_tuned=False).module.config["ROWS"] == 1
