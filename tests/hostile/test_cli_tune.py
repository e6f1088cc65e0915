"""`duotile tune` refuses what it cannot do before the sweep starts, in one line (exit 2), and puts
its report and plot under the cache, not in the working directory."""

from __future__ import annotations

import errno
import json

import pytest

from duotile.cli import main
from duotile.passes.autotune import report, tuner

from .test_cli_errors import KERNELS, one_error_line

RMSNORM = ["tune", "rmsnorm", "--target", "interpret", "--shape", "T=3", "--shape", "D=64", "--budget", "quick",
           "--pin", "ROWS=2", "--no-progress"]


@pytest.fixture
def no_sweep(monkeypatch):
    """Every test here that expects a refusal also proves no sweep started."""

    def refuse(*a, **k):
        raise AssertionError("the sweep started")

    monkeypatch.setattr(tuner, "tune", refuse)


def test_without_case_or_shape_the_cases_and_sizes_are_named(capsys, no_sweep):
    line = one_error_line(capsys, ["tune", "gemm", "--target", "sm100"])
    assert line.startswith("duotile tune: give --case or --shape NAME=VALUE for every size: gemm has sizes M, N, K; "
                           "options ")
    assert "dtype" in line and "scales" in line
    assert "--shape M=... --shape N=... --shape K=..." in line
    assert ("cases: bf16_128, bf16_ragged, bf16_scaled, fp8_scaled, fp8_plain, fp8_split4, bf16_split8_scaled, "
            "bf16_f32out, bf16_f32out_split4, bf16_8192, fp8_8192") in line
    line = one_error_line(capsys, ["tune", "flash_attention", "--target", "sm100"])
    assert "flash_attention has sizes B, H, S, D; options causal" in line


@pytest.mark.parametrize("shape, line", [
    (["M=128"], "duotile tune: --shape: no size for N, K; gemm needs every one of M, N, K"),
    (["M=128", "N=abc", "K=64"], "duotile tune: --shape N=abc: a size is a whole number of 1 or more"),
    (["M=128", "N=0", "K=64"], "duotile tune: --shape N=0: a size is a whole number of 1 or more"),
    (["M=128", "N=-8", "K=64"], "duotile tune: --shape N=-8: a size is a whole number of 1 or more"),
    (["M=128", "N=1.5", "K=64"], "duotile tune: --shape N=1.5: a size is a whole number of 1 or more"),
    (["M=128", "N=64", "K=64", "casual=true"],
     "duotile tune: --shape casual: gemm has no such field; it has sizes M, N, K; options scales, dtype"),
])
def test_missing_or_bad_sizes(capsys, no_sweep, shape, line):
    argv = ["tune", "gemm", "--target", "sm100"] + [a for s in shape for a in ("--shape", s)]
    got = one_error_line(capsys, argv)
    if "options" in line:  # the options' order follows the spec's cases
        assert got.startswith(line.split("; options")[0]) and "scales" in got and "dtype" in got
    else:
        assert got == line


def test_shape_without_equals_is_an_argparse_error(capsys, no_sweep):
    with pytest.raises(SystemExit) as exc:
        main(["tune", "gemm", "--shape", "M"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --shape: expected NAME=VALUE, got 'M'" in err and "Traceback" not in err


def test_unknown_kernel_case_and_target(capsys, no_sweep):
    assert one_error_line(capsys, ["tune", "nope", "--shape", "M=1"]) == \
        f"duotile tune: no kernel named 'nope'; known: {KERNELS}"
    line = one_error_line(capsys, ["tune", "gemm", "--case", "zz"])
    assert line.startswith("duotile tune: gemm has no case 'zz'; cases: bf16_128,")
    line = one_error_line(capsys, ["tune", "gemm", "--case", "bf16_128", "--target", "sm42"])
    assert line == "duotile tune: unknown target 'sm42'; known: interpret, sm90, sm100, ascend950"


def test_sm90_without_a_gpu_names_the_compile_only_targets(capsys, no_sweep, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = one_error_line(capsys, ["tune", "gemm", "--case", "bf16_128"])  # sm90 is the default target
    assert line.startswith("duotile tune: target sm90 measures every candidate on a CUDA GPU and this machine has "
                           "none")
    assert "the compile-only targets sm100 and ascend950 tune without one, ranked by a cost model" in line


@pytest.mark.parametrize("pin, line", [
    ("XX=1", "duotile tune: --pin XX: gemm has no tunable 'XX' and sm100 no such knob; tunables: BM, BN, BK, "
             "STAGES, SPLIT; sm100 knobs: threads, raster, ftz"),
    ("BM=7", "duotile tune: --pin BM=7: not one of [128, 64, 256]"),
    ("BM=big", "duotile tune: --pin BM=big: not one of [128, 64, 256]"),
    ("threads=7", "duotile tune: --pin threads=7: not one of [256, 128, 512], or 32 or 64 for a kernel "
                  "without a gemm"),
])
def test_pin_errors(capsys, no_sweep, pin, line):
    assert one_error_line(capsys, ["tune", "gemm", "--target", "sm100", "--case", "bf16_128", "--pin", pin]) == line


def test_out_pointing_at_a_file_is_refused_before_the_sweep(capsys, no_sweep, tmp_path):
    f = tmp_path / "results.txt"
    f.write_text("keep me")
    line = one_error_line(capsys, ["tune", "gemm", "--target", "sm100", "--case", "bf16_128", "--out", str(f)])
    assert line == f"duotile tune: --out {f}: is a file, not a folder"
    line = one_error_line(capsys, ["tune", "gemm", "--target", "sm100", "--case", "bf16_128",
                                   "--out", str(f / "sub")])
    assert line == f"duotile tune: --out {f / 'sub'}: cannot create the folder (Not a directory)"
    line = one_error_line(capsys, ["tune", "gemm", "--target", "sm100", "--case", "bf16_128",
                                   "--cache-dir", str(f)])
    assert line == f"duotile tune: --cache-dir {f}: is a file, not a folder"
    assert f.read_text() == "keep me"


def test_report_and_plot_default_under_the_cache(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert main(RMSNORM) == 0
    out = capsys.readouterr().out
    where = tmp_path / "cache" / "tune"
    assert f"report: {where / 'rmsnorm_interpret.json'}" in out
    assert f"plot:   {where / 'rmsnorm_interpret.png'}" in out
    assert json.loads((where / "rmsnorm_interpret.json").read_text())["kernel"] == "rmsnorm"
    assert (where / "rmsnorm_interpret.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # nothing in the working directory


def test_a_report_that_cannot_be_written_goes_to_the_cache_and_says_so(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path / "cache"))
    out_dir = tmp_path / "out"
    real = report.write_json

    def disk_full(r, path):
        if out_dir in path.parents:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(r, path)

    monkeypatch.setattr(report, "write_json", disk_full)
    assert main([*RMSNORM, "--out", str(out_dir), "--no-cache"]) == 0
    out = capsys.readouterr().out
    kept = tmp_path / "cache" / "tune" / "rmsnorm_interpret.json"
    assert f"report: {kept} (could not write {out_dir / 'rmsnorm_interpret.json'}: No space left on device)" in out
    assert json.loads(kept.read_text())["kernel"] == "rmsnorm"
    assert (out_dir / "rmsnorm_interpret.png").exists()  # the plot could go where it was asked


def test_shortlist_and_shape_flags_say_what_they_need(capsys):
    from duotile.cli import main

    for argv, want in ((["tune", "gemm", "--shapes", "x"], "--shapes picks and builds a model's shapes: give --model"),
                       (["tune", "gemm", "--budget", "shortlist", "--case", "bf16_128"], "give --model too"),
                       (["tune", "gemm", "--model", "v41-flash", "--target", "sm100", "--budget", "shortlist"],
                        "sm100 ranks by a cost model: use --budget quick"),
                       (["tune", "gemm", "--model", "v41-flash", "--target", "sm100", "--shapes", "nope*"],
                        "no v41-flash shape of gemm matches"),
                       (["tune", "gemm", "--model", "v41-flash", "--target", "sm100", "--jobs", "0"],
                        "--jobs 0: give 1 or more")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert want in err and err.count("\n") == 1, err
