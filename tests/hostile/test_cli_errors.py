"""Mistakes on the `duotile` command line: each ends in one line on stderr naming the problem (and
the choices), exit status 2 and no traceback; `--debug` shows the traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from duotile.cli import main
from duotile.kernels_spec.registry import load_all

KERNELS = ", ".join(sorted(load_all()))  # every registered spec, as the error lists them


def one_error_line(capsys, argv: list[str], code: int = 2) -> str:
    """Runs ``duotile argv``; asserts the exit code, that stderr is one line and no traceback."""
    assert main(argv) == code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def run_duotile(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "duotile.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


# -- show -----------------------------------------------------------------------------------------
def test_show_unknown_kernel_names_the_known_ones(capsys):
    line = one_error_line(capsys, ["show", "nope", "--target", "interpret", "--stage", "ir"])
    assert line == f"duotile show: no kernel named 'nope'; known: {KERNELS}"


def test_show_unknown_case_lists_build_and_test_cases(capsys):
    line = one_error_line(capsys, ["show", "gemm", "--target", "interpret", "--stage", "ir", "--case", "zz"])
    assert line.startswith("duotile show: gemm has no case 'zz'; build cases: bf16_8192, fp8_8192; test cases: ")
    assert "bf16_128" in line


def test_show_unknown_stage_is_refused_before_any_build(capsys, monkeypatch):
    from duotile.codegen import cli as codegen_cli

    def no_build(*a, **k):
        raise AssertionError("built although the stage does not exist")

    monkeypatch.setattr(codegen_cli, "build_case", no_build)
    line = one_error_line(capsys, ["show", "gemm", "--target", "sm100", "--stage", "assembly"])
    assert line == "duotile show: target sm100 has no stage 'assembly'; it has: ir, tilelang, cuda, ptx, sass"


def test_show_unknown_target_is_an_argparse_choice(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["show", "gemm", "--target", "sm42"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'sm42'" in err and "'sm90'" in err and "Traceback" not in err


def test_show_config_errors(capsys):
    line = one_error_line(capsys, ["show", "gemm", "--target", "interpret", "--stage", "ir", "--config", "XX=1"])
    assert line.startswith("duotile show: --config XX: gemm has no tunable 'XX'")
    assert "tunables: BM, BN, BK, STAGES" in line
    line = one_error_line(capsys, ["show", "gemm", "--target", "interpret", "--stage", "ir", "--config", "BM"])
    assert line == "duotile show: --config expects NAME=VALUE, got 'BM'"


def test_show_case_may_be_a_test_case(capsys):
    assert main(["show", "gemm", "--target", "interpret", "--stage", "ir", "--case", "bf16_128"]) == 0
    assert "kernel gemm(" in capsys.readouterr().out


# -- build ----------------------------------------------------------------------------------------
def test_build_unknown_kernel_and_target(capsys):
    line = one_error_line(capsys, ["build", "--kernel", "nope", "--target", "interpret"])
    assert line == f"duotile build: no kernel named 'nope'; known: {KERNELS}"
    line = one_error_line(capsys, ["build", "--kernel", "rmsnorm", "--target", "interpret,sm42"])
    assert line == "duotile build: unknown target(s) sm42; known: interpret, sm90, sm100, ascend950"
    line = one_error_line(capsys, ["build", "--kernel", "rmsnorm", "--target", ","])
    assert line.startswith("duotile build: unknown target(s) ','")
    line = one_error_line(capsys, ["build", "--kernel", "rmsnorm", "--jobs", "0"])
    assert line == "duotile build: --jobs must be 1 or more, got 0"


# -- the wrapper in duotile.cli.main --------------------------------------------------------------
@pytest.fixture
def failing_list(monkeypatch):
    """`duotile list` raising what the test gives."""
    from duotile.codegen import cli as codegen_cli

    def use(err: BaseException):
        def boom():
            raise err

        monkeypatch.setattr(codegen_cli, "load_all", boom)

    return use


@pytest.mark.parametrize("err, line", [
    (KeyError("no spec 'x'"), "duotile list: no spec 'x'"),
    (ValueError("bad value\nsecond line of detail"), "duotile list: bad value"),
    (FileNotFoundError(2, "No such file or directory", "/nowhere/specs"),
     "duotile list: /nowhere/specs: No such file or directory"),
    (PermissionError(13, "Permission denied", "/root/x"), "duotile list: /root/x: Permission denied"),
    (RuntimeError("the toolchain is missing"), "duotile list: the toolchain is missing"),
])
def test_user_errors_end_in_one_line_and_exit_2(capsys, failing_list, err, line):
    failing_list(err)
    assert one_error_line(capsys, ["list"]) == line


def test_project_errors_are_user_errors(capsys, failing_list):
    from duotile.dsl.errors import CapacityError, LoweringError
    from duotile.runtime.config import ConfigError
    from duotile.runtime.weights import CheckpointError

    for err in (CapacityError("sm100", "TMEM", 1024, 512), ConfigError("config.json: hidden_size missing"),
                CheckpointError("model.safetensors: truncated"),
                LoweringError("sm90", "TileLang", "gemm", {"BM": 64}, RuntimeError("layout\nmore"))):
        failing_list(err)
        line = one_error_line(capsys, ["list"])
        assert line == f"duotile list: {str(err).splitlines()[0]}"


def test_a_bug_says_internal_error_and_how_to_see_the_traceback(capsys, failing_list):
    failing_list(TypeError("unsupported operand"))
    line = one_error_line(capsys, ["list"], code=1)
    assert line == ("duotile list: internal error: TypeError: unsupported operand (run again with --debug for "
                    "the traceback)")


def test_debug_reraises_before_or_after_the_command(failing_list):
    failing_list(ValueError("bad value"))
    with pytest.raises(ValueError, match="bad value"):
        main(["--debug", "list"])
    with pytest.raises(ValueError, match="bad value"):
        main(["list", "--debug"])


def test_interrupt_is_one_line_and_exit_130(capsys, failing_list):
    failing_list(KeyboardInterrupt())
    assert one_error_line(capsys, ["list"], code=130) == "duotile list: interrupted"


def test_in_a_real_process_one_line_without_and_a_traceback_with_debug():
    p = run_duotile("tune", "nope", "--shape", "M=1")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"duotile tune: no kernel named 'nope'; known: {KERNELS}"
    p = run_duotile("--debug", "tune", "nope", "--shape", "M=1")
    assert p.returncode == 1 and "Traceback (most recent call last)" in p.stderr
    assert "KeyError" in p.stderr
    p = run_duotile("tune", "nope", "--shape", "M=1", env={"DUOTILE_DEBUG": "1"})
    assert "Traceback (most recent call last)" in p.stderr
