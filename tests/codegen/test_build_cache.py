"""The artifact cache: stable keys, hits, and never trusting a damaged entry."""

from __future__ import annotations

import json

import torch

from duotile.codegen import build
from duotile.codegen.build import artifact_key, build_module
from duotile.codegen.compile import specialize
from duotile.codegen.target import get_target
from duotile.kernels_spec import get


def _module(config=None):
    spec = get("rmsnorm")
    sig = spec.kernel.bind(spec.make_inputs({"T": 4, "D": 64}, torch.device("cpu"), 0))
    return spec.kernel, specialize(spec.kernel, sig, "interpret", config)


def test_key_is_stable_across_traces_and_changes_with_config():
    # regression: value ids come from a global counter, so two traces of one kernel used to differ
    target = get_target("interpret")
    kernel, (m1, k1) = _module()
    _, (m2, k2) = _module()
    _, (m3, k3) = _module({"ROWS": 2})
    assert artifact_key(m1, target, k1) == artifact_key(m2, target, k2)
    assert artifact_key(m1, target, k1) != artifact_key(m3, target, k3)


def test_key_changes_with_the_compiler_sources(monkeypatch):
    # regression: an edited generator used to reuse the artifacts the old one had cached
    target = get_target("interpret")
    _, (module, knobs) = _module()
    before = artifact_key(module, target, knobs)
    assert len(build.compiler_digest()) == 16
    monkeypatch.setattr(build, "compiler_digest", lambda: "edited")
    assert artifact_key(module, target, knobs) != before


def test_hit_then_corrupt_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    target = get_target("interpret")
    kernel, (module, knobs) = _module()
    first = build_module(kernel, module, target, knobs)
    assert first.meta["cache"] == "miss"
    assert build_module(kernel, module, target, knobs).meta["cache"] == "hit"
    meta = tmp_path / "artifacts" / "rmsnorm" / "interpret" / first.meta["key"] / "meta.json"
    meta.write_text(json.dumps({"kernel": "rmsnorm"})[:-3])  # truncated JSON
    again = build_module(kernel, module, target, knobs)
    assert again.meta["cache"] == "stale->rebuilt" and "ir" in again.stages
    assert "meta.json" in again.meta["cache_problem"]
    assert build_module(kernel, module, target, knobs).meta["cache"] == "hit"
