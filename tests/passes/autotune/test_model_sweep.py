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
