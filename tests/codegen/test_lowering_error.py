"""A toolchain failure on generated code is reported as a LoweringError that names the target, the
kernel and its whole config (TileLang's own errors name only its passes), and the generated
source still prints: `duotile show --stage tilelang` needs no lowering."""

from __future__ import annotations

import pytest

from duotile.cli import main
from duotile.codegen.driver import build_case
from duotile.codegen.tilelang_ascend import target as ascend_target
from duotile.codegen.tilelang_cuda import toolchain
from duotile.kernels_spec import load_all

pytest.importorskip("tilelang")


@pytest.fixture
def failing_lowering(monkeypatch, tmp_path):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))  # no cached artifact skips the lowering

    def fail(prim, sm, configs=None):
        raise RuntimeError("layout inference gave up\nsecond line of TileLang's trace")

    monkeypatch.setattr(toolchain, "lower_checked", fail)


def test_a_lowering_failure_names_the_target_kernel_and_config(failing_lowering):
    spec = load_all()["rmsnorm"]
    r = build_case(spec, "hidden", spec.build_cases["hidden"], "sm90", config={"threads": 256}, use_tuned=False)
    assert not r.ok
    assert r.error.startswith("LoweringError: sm90: TileLang ")
    assert "could not lower the generated rmsnorm (config {" in r.error and "'threads': 256" in r.error
    assert r.error.endswith("RuntimeError: layout inference gave up")  # the first line of the cause only


def test_show_prints_the_generated_source_even_when_lowering_fails(failing_lowering, capsys):
    assert main(["show", "rmsnorm", "--target", "sm90", "--stage", "tilelang"]) == 0
    assert "@T.prim_func" in capsys.readouterr().out
    assert main(["show", "rmsnorm", "--target", "sm90", "--stage", "cuda"]) == 1
    assert "LoweringError: sm90" in capsys.readouterr().err


def test_an_ascend_lowering_failure_is_named_too(monkeypatch, tmp_path):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))

    def fail(path):
        raise ValueError("unsupported intrinsic")

    monkeypatch.setattr(ascend_target, "lower_file", fail)
    spec = load_all()["rmsnorm"]
    r = build_case(spec, "hidden", spec.build_cases["hidden"], "ascend950", use_tuned=False)
    assert not r.ok and not r.rejected
    assert r.error.startswith("LoweringError: ascend950: TileLang ")
    assert "(Ascend) could not lower the generated rmsnorm" in r.error
    assert r.error.endswith("ValueError: unsupported intrinsic")
