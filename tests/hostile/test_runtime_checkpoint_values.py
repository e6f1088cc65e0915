"""Corrupt values in a checkpoint: a clear CheckpointError at load where the format can tell, a warning
or a digest mismatch from `duotile check-model` where it cannot."""

from __future__ import annotations

import pytest
import torch

from duotile.cli import main
from duotile.runtime.engine import LLM
from duotile.runtime.loader import preset_dir
from duotile.runtime.weights import Checkpoint, CheckpointError

from .runtime_support import copy_of, rewrite_tensor


def _u8(t: torch.Tensor, fn) -> torch.Tensor:
    """Edit a float8 tensor's raw codes."""
    codes = t.view(torch.uint8).clone()
    fn(codes)
    return codes.view(t.dtype)


def _nan_norm(t):
    t[3] = float("nan")
    return t


CASES = [
    ("layers.2.attn_norm.weight", _nan_norm, "non-finite values"),
    ("layers.1.attn.wq_b.scale", lambda t: _u8(t, lambda c: c.__setitem__((0, 0), 0xFF)), "NaN UE8M0"),
    ("layers.3.ffn.experts.2.w1.scale", lambda t: _u8(t, lambda c: c.__setitem__((5, 1), 0xFF)), "NaN UE8M0"),
    ("layers.0.attn.wkv.weight", lambda t: _u8(t, lambda c: c.__setitem__((1, 2), 0x7F)), "NaN e4m3"),
    ("layers.0.attn.wkv.weight", lambda t: _u8(t, lambda c: c.__setitem__((1, 2), 0xFF)), "NaN e4m3"),
    ("head.weight", torch.zeros_like, "all values are zero"),
    ("layers.0.ffn.gate.tid2eid", lambda t: t.fill_(99), "expert ids outside [0, 16)"),
    ("layers.2.hc_attn_scale", lambda t: t.fill_(float("inf")), "non-finite values"),
]


@pytest.mark.parametrize(("tensor", "corrupt", "words"), CASES)
def test_corrupt_value_fails_the_load_naming_tensor_and_file(tmp_path, tensor, corrupt, words):
    path = copy_of("v4-tiny", tmp_path / "c")
    shard = rewrite_tensor(path, tensor, corrupt)
    with pytest.raises(CheckpointError) as err:
        LLM(str(path))
    msg = str(err.value)
    assert msg.startswith(f"tensor {tensor} in ") and shard.name in msg and words in msg


def test_check_model_lists_every_error_and_exits_1(tmp_path, capsys):
    path = copy_of("v4-tiny", tmp_path / "c")
    rewrite_tensor(path, "layers.2.attn_norm.weight", _nan_norm)
    rewrite_tensor(path, "layers.1.attn.wq_b.scale", CASES[1][1])
    assert main(["check-model", str(path)]) == 1
    out = capsys.readouterr().out
    assert "error: tensor layers.2.attn_norm.weight in model-" in out
    assert "error: tensor layers.1.attn.wq_b.scale in model-" in out and "NaN UE8M0" in out
    assert "values: 2 error(s)" in out


def test_zeroed_weight_is_a_warning_not_an_error(tmp_path, capsys):
    """An all-zero projection is valid data (the model still runs); check-model warns, the load proceeds."""
    path = copy_of("v4-tiny", tmp_path / "c")
    rewrite_tensor(path, "layers.1.attn.wo_b.weight", torch.zeros_like)
    assert main(["check-model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: tensor layers.1.attn.wo_b.weight" in out and "all values are zero" in out
    assert "0 error(s), 1 warning(s)" in out
    Checkpoint.open(path).get("layers.1.attn.wo_b")  # loads


def test_flipped_fp4_bytes_are_undetectable_in_a_checkpoint_and_said_so(tmp_path, capsys):
    path = copy_of("v4-tiny", tmp_path / "c")
    rewrite_tensor(path, "layers.2.ffn.experts.0.w2.weight", lambda t: t ^ 0x5A)
    assert main(["check-model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "0 error(s)" in out and "cannot be found from the data" in out


def test_flipped_fp4_bytes_in_the_embedded_preset_fail_its_digest(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DUOTILE_CACHE", str(tmp_path))
    path = preset_dir("v4-tiny")
    rewrite_tensor(path, "layers.2.ffn.experts.0.w2.weight", lambda t: t ^ 0x5A)  # same size, other bytes
    assert main(["check-model", "v4-tiny"]) == 1
    out = capsys.readouterr().out
    assert "preset digest: model-" in out and "does not match its SHA-256" in out


def test_check_model_of_a_released_preset_is_config_only(capsys):
    assert main(["check-model", "v41-flash"]) == 0
    out = capsys.readouterr().out
    assert "config only" in out and "does NOT fit" in out  # 2.8 TiB of FP32 weights


def test_check_model_on_a_missing_path_is_one_line_exit_2(tmp_path, capsys):
    assert main(["check-model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "neither a checkpoint directory nor a preset" in err
