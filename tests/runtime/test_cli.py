"""`duotile generate`: default embedded model on a fresh cache, explicit checkpoints, errors."""

from __future__ import annotations

from duotile.cli import main
from duotile.runtime.engine import LLM
from duotile.runtime.sampler import SamplingParams


def test_generate_with_the_embedded_default_model_on_a_fresh_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    assert main(["generate", "--prompt-ids", "1", "2", "3", "--max-tokens", "5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "models" / "v41-tiny" / "config.json").is_file()
    tokens = [int(t) for t in out.splitlines()[0].removeprefix("tokens:").split()]
    assert len(tokens) == 5
    assert "tokens/s" in out and "cache bytes:" in out
    expected = LLM(str(tmp_path / "models" / "v41-tiny")).generate([1, 2, 3], SamplingParams(max_tokens=5))
    assert tokens == expected[0].token_ids


def test_generate_sampled_and_batch_invariant_with_a_checkpoint(ckpt_dir, capsys):
    args = ["generate", "--model", ckpt_dir("v4-tiny"), "--prompt-ids", "9", "8", "7", "--max-tokens", "6",
            "--temperature", "1.0", "--seed", "5", "--no-progress"]
    assert main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert main([*args, "--batch-invariant"]) == 0
    second = capsys.readouterr().out.splitlines()[0]
    want = LLM(ckpt_dir("v4-tiny"), batch_invariant=True).generate(
        [9, 8, 7], SamplingParams(temperature=1.0, seed=5, max_tokens=6))[0].token_ids
    assert second == "tokens: " + " ".join(map(str, want))
    assert len(first.split()) == 7


def test_generate_reports_errors(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt-ids", "1"]) == 2
    assert "neither a checkpoint directory nor a preset" in capsys.readouterr().err
    assert main(["generate", "--model", "v4-flash", "--prompt-ids", "1"]) == 2
    assert "without embedded weights" in capsys.readouterr().err
    assert main(["generate", "--model", "v4-tiny", "--prompt-ids", "1", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_generate_build_ahead_runs_a_short_form_of_the_requests_in_rounds(ckpt_dir, monkeypatch, capsys):
    """``--build-ahead JOBS``: ``build_ahead`` gets the generated ops, JOBS, and a workload that
    generates the same requests at two tokens each; the generation then runs as asked."""
    from duotile.runtime.generated import ahead

    seen = {}

    def fake(ops, workload, jobs, log=None):
        seen["jobs"], seen["ops"] = jobs, type(ops).__name__
        seen["lengths"] = [len(o.token_ids) for o in workload()]
        return ahead.Report([ahead.Round(0, 0, 0.0, 0.0)], set())

    monkeypatch.setattr(ahead, "build_ahead", fake)
    args = ["generate", "--model", ckpt_dir("v4-tiny"), "--prompt-ids", "4", "5", "--max-tokens", "3",
            "--requests", "2", "--kernels", "generated", "--no-progress", "--build-ahead", "3"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert seen == {"jobs": 3, "ops": "GeneratedOps", "lengths": [1, 2]}  # --requests' cut: 1 and 2 tokens
    assert "build ahead: 0 builds in 1 rounds" in out.err and len(out.out.splitlines()[0].split()) == 4
    assert main(["generate", "--prompt-ids", "1", "--build-ahead", "2"]) == 2
    assert "--build-ahead needs --kernels generated" in capsys.readouterr().err


def test_graphs_need_the_generated_kernels_and_a_cuda_device(ckpt_dir, capsys):
    assert main(["generate", "--prompt-ids", "1", "--graphs"]) == 2
    err = capsys.readouterr().err
    assert "--graphs needs --kernels generated" in err and "note: --graphs is experimental" in err
    args = ["generate", "--model", ckpt_dir("v41-tiny"), "--prompt-ids", "1", "--kernels", "generated", "--graphs"]
    assert main(args) == 2
    assert "CUDA graphs replay generated kernels on a CUDA device; this model runs generated ops on cpu" in \
        capsys.readouterr().err
