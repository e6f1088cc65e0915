"""Prebuilding call signatures: found from a run's kernels, saved and loaded as JSON, built in worker
processes into the artifact cache where the same call later finds them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from duotile import codegen
from duotile.codegen import prebuild
from duotile.kernels_spec import get


def _rmsnorm_calls(rows: list[int], width: int = 64):
    kernel = codegen.compile(get("rmsnorm").kernel, "interpret", constants={"EPS": 1e-6})
    for n in rows:
        x = torch.randn(n, width)
        kernel(x=x, weight=torch.ones(width), y=torch.empty_like(x))
    return kernel


def test_calls_that_differ_in_a_dynamic_size_share_one_signature(tmp_path):
    kernel = _rmsnorm_calls([3, 5, 9])  # the token count is dynamic: one build serves all three
    wide = _rmsnorm_calls([2], width=128)
    sigs = prebuild.signatures_of([kernel, wide])
    assert [s.spec for s in sigs] == ["rmsnorm", "rmsnorm"]
    assert {dict((n, shape) for n, shape, _ in s.tensors)["weight"] for s in sigs} == {(64,), (128,)}
    assert sigs[0].constants == (("EPS", 1e-6),)
    path = tmp_path / "sigs.json"
    prebuild.save(sigs, path)
    assert prebuild.load(path) == sigs
    assert json.loads(path.read_text())[0]["tensors"][0] == ["x", [3, 64], "float32"]


def test_a_file_that_is_not_a_signature_list_is_refused_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"spec": "rmsnorm"}')
    with pytest.raises(ValueError, match=r"bad\.json: not a list of build signatures"):
        prebuild.load(bad)


def test_a_signature_that_cannot_build_is_reported_not_raised():
    sig = prebuild.Signature("rmsnorm", (("x", (4, 64), "float32"),), ())  # weight and y missing
    (out,) = prebuild.prebuild([sig], "sm90", jobs=1, prepare_load=False)
    assert not out.ok and out.error


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_prebuilt_signature_is_a_cache_hit_at_its_call(tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    sigs = prebuild.signatures_of([_rmsnorm_calls([7])])
    (first,) = prebuild.prebuild(sigs, "sm90", jobs=1, prepare_load=False)
    assert first.ok and first.cache == "miss" and first.config["ROWS"] >= 1, first
    built = sorted(tmp_path.rglob("meta.json"))
    kernel = codegen.compile(get("rmsnorm").kernel, "sm90", constants={"EPS": 1e-6})
    with torch.device("meta"):  # another token count: the same dynamic build
        art = kernel.artifact(x=torch.empty(300, 64), weight=torch.empty(64), y=torch.empty(300, 64))
    assert art.meta["cache"] == "hit" and sorted(tmp_path.rglob("meta.json")) == built


def test_duotile_build_takes_a_signature_file(tmp_path, capsys, monkeypatch):
    from duotile.cli import main

    path = tmp_path / "sigs.json"
    prebuild.save(prebuild.signatures_of([_rmsnorm_calls([4])]), path)
    assert main(["build", "--signatures", str(path), "--target", "interpret", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm" in out and "1 built (1 found in the cache), 0 failed (1 signatures from" in out  # by the calls
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path / "empty-cache"))
    assert main(["build", "--signatures", str(path), "--target", "interpret", "--jobs", "1"]) == 0
    assert "1 built (0 found in the cache), 0 failed" in capsys.readouterr().out
    assert main(["build", "--signatures", str(tmp_path / "missing.json"), "--target", "interpret"]) == 2
    assert "not a list of build signatures" in capsys.readouterr().err


def test_save_builds_needs_generated_kernels(capsys):
    from duotile.cli import main

    assert main(["generate", "--prompt-ids", "1", "--max-tokens", "1", "--save-builds", "x.json"]) == 2
    assert "--save-builds needs --kernels generated" in capsys.readouterr().err

