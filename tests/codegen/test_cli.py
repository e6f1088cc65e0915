"""The `duotile` command: list, build, show (on the interpreter target, so it runs anywhere)."""

from __future__ import annotations

from duotile.cli import main


def test_list_names_every_kernel(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("rmsnorm", "gemm", "flash_attention", "gather_rows"):
        assert name in out


def test_build_prints_a_row_per_case_and_target(capsys):
    assert main(["build", "--kernel", "rmsnorm", "--target", "interpret"]) == 0
    out = capsys.readouterr().out
    assert "rmsnorm  hidden" in out and "interpret  ok" in out and "2 built, 0 rejected" in out


def test_build_rejects_unknown_names(capsys):
    assert main(["build", "--kernel", "nope"]) == 2
    assert main(["build", "--target", "sm42"]) == 2
    err = capsys.readouterr().err
    assert "no kernel named 'nope'" in err and "unknown target(s) sm42" in err


def test_show_prints_a_stage_or_says_which_exist(capsys):
    assert main(["show", "gemm", "--target", "interpret", "--stage", "ir"]) == 0
    assert "kernel gemm(" in capsys.readouterr().out
    assert main(["show", "gemm", "--target", "interpret", "--stage", "ptx"]) == 2
    assert "has no stage 'ptx'" in capsys.readouterr().err


def test_show_prints_every_phase_of_a_split_kernel(capsys):
    assert main(["show", "gemm_splitk", "--target", "interpret", "--stage", "ir"]) == 0
    out = capsys.readouterr().out
    assert "# ---- phase 0 of 2: gemm_splitk_p0 ----" in out and "# ---- phase 1 of 2: gemm_splitk_p1 ----" in out
    assert out.count("kernel gemm_splitk_p") == 2 and "partial: workspace<4 x n_M x 4096 x f32>" in out


def test_build_reports_a_target_that_refuses_an_op_as_refused_not_failed(capsys):
    """A target that does not lower an op of the kernel says so, naming the op: the build
    table marks it refused and the command still succeeds (a failure is something else)."""
    code = main(["build", "--kernel", "quantize", "--target", "ascend950"])
    out = capsys.readouterr().out
    assert "refused" in out and "UnsupportedError" in out and "reduces whole 256-byte VRegs" in " ".join(out.split())
    assert code == 0 and "1 refused by the target" in out and "0 failed" in out
