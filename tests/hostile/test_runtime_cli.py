"""`duotile generate` / `check-model` options: help with defaults, the --seed note, one-line device errors."""

from __future__ import annotations

import argparse

import pytest
import torch

from duotile.cli import build_parser, main

from .runtime_support import tiny


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["generate", "check-model"])
def test_every_option_has_help_that_shows_its_default(command):
    sub = _subparser(command)
    mine = [a for a in sub._actions if not isinstance(a, argparse._HelpAction) and a.dest != "debug"]
    assert mine
    for action in mine:
        assert action.help and "default" in action.help.lower(), action.dest
    text = " ".join(sub.format_help().split())
    for action in mine:
        if action.default is not None and not isinstance(action.default, bool):
            assert f"default: {action.default})" in text, action.dest


def test_seed_help_says_it_does_nothing_under_greedy():
    seed = next(a for a in _subparser("generate")._actions if a.dest == "seed")
    assert "no effect under greedy" in seed.help


def test_seed_with_temperature_0_prints_a_note_and_changes_nothing(capsys):
    args = ["generate", "--model", str(tiny("v4-tiny")), "--prompt-ids", "5", "6", "--max-tokens", "3"]
    assert main(args) == 0
    plain = capsys.readouterr()
    assert main([*args, "--seed", "123"]) == 0
    seeded = capsys.readouterr()
    notes = [line for line in seeded.err.splitlines() if line.startswith("note:")]
    assert notes == ["note: --seed has no effect with --temperature 0 (greedy decoding picks the most likely token)"]
    assert "note:" not in plain.err
    assert seeded.out.splitlines()[0] == plain.out.splitlines()[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_generate_on_cuda_without_cuda_is_one_line_and_exit_2(capsys):
    assert main(["generate", "--prompt-ids", "1", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cuda is not available" in err[0] and "this machine has cpu" in err[0]


def test_debug_shows_the_exception_instead(capsys):
    with pytest.raises(ValueError, match="device: unknown device 'tpu'"):
        main(["generate", "--prompt-ids", "1", "--device", "tpu", "--debug"])


def test_generate_with_nan_logits_keeps_the_tokens_and_fails_in_one_line(monkeypatch, capsys):
    from duotile.runtime.reference import Model

    forward = Model.forward

    def nan_after_two(self, chunks, all_logits=False):
        out = forward(self, chunks, all_logits)
        return [torch.full_like(o, float("nan")) if c.cache.num_tokens > 3 else o for c, o in zip(chunks, out)]

    monkeypatch.setattr(Model, "forward", nan_after_two)
    args = ["generate", "--model", str(tiny("v4-tiny")), "--prompt-ids", "5", "6", "7", "--max-tokens", "4"]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()[0].split()) == 5  # "tokens (before the failure):" + 1 token
    assert captured.out.startswith("tokens (before the failure): ")
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("duotile generate: request 0: ") and "position 4" in err[0]
