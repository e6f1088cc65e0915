"""Every option of every `duotile` sub-command has help, and `--help` shows its default; the build
table keeps whole notes."""

from __future__ import annotations

import argparse

import pytest

from duotile.cli import HelpFormatter, build_parser, main
from duotile.codegen import cli as codegen_cli
from duotile.codegen.driver import BuildResult


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def says_nothing(default) -> bool:
    return default is None or default is False or default == [] or default is argparse.SUPPRESS


def test_the_commands_are_all_there():
    assert {"list", "build", "show", "tune", "generate"} <= set(subcommands())


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_option_has_help_that_shows_its_default(name):
    parser = subcommands()[name]
    formatter = HelpFormatter(prog="duotile")
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        what = f"duotile {name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help is not argparse.SUPPRESS and action.help.strip(), f"{what} has no help"
        if not says_nothing(action.default):
            shown = formatter._get_help_string(action) % {**vars(action), "default": action.default}
            assert str(action.default) in shown or "(default" in shown.lower(), f"{what} hides its default"
    text = parser.format_help()
    assert text.startswith(f"usage: duotile {name}")


def test_help_of_the_main_command_lists_debug(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--debug" in out and "tune" in out and "exit status 2" in out


def test_tune_help_names_its_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: sm90)" in out and "default: default, or quick with --model" in out
    assert "$DUOTILE_CACHE/tune" in out
    # every budget is described by what it tries; the shortlist's searches nothing, so no "up to 0"
    assert "up to 0 " not in out and "shortlist: the default and up to 8 configs" in out


LONG = ("CapacityError: sm100: TMEM overflow: needs 1048576 bytes (1024.0 KiB), capacity 262144 bytes (256.0 KiB); "
        "the accumulator of 128 x 512 f32 with two buffers does not fit the tensor memory; try --config BN=64 or "
        "BM=64 and read docs/dsl.md on the head dim 512 case")


def test_build_table_keeps_whole_notes(capsys, monkeypatch):
    def fake_build(spec, cname, case, target, **kw):
        return BuildResult(spec.name, cname, target, False, 0.1, error=LONG + "\nsecond line of the cause",
                           rejected=True)

    monkeypatch.setattr(codegen_cli, "build_case", fake_build)
    assert main(["build", "--kernel", "rmsnorm", "--target", "interpret"]) == 0  # rejected, not failed
    out = capsys.readouterr().out
    table, rest = out.split("\nnotes:\n")
    notes, summary = rest.split("\n\n")
    assert "[1] CapacityError" in table and "[2] CapacityError" in table and "TMEM" not in table
    assert notes.lstrip().startswith("[1] rmsnorm hidden interpret: CapacityError: sm100")
    flat = " ".join(notes.split())
    assert flat.count(" ".join(LONG.split())) == 2  # every word, in order, for each row
    assert flat.count("second line of the cause") == 2
    assert max(len(line) for line in notes.splitlines()) <= 120
    assert summary.startswith("0 built, 2 rejected by a capacity check")
