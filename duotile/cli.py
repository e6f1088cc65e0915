"""The `duotile` command. Each area registers its own sub-commands.

A module listed in COMMAND_MODULES exposes ``register(subparsers)``, which adds its
sub-commands with ``set_defaults(func=...)``; ``func(args)`` returns the exit code.

A mistake on the command line ends in one line on stderr, ``duotile <command>: <what is wrong>``,
and exit status 2 (argparse's own errors exit 2 as well); ``--debug`` shows the traceback instead.
An interrupt ends in one line and status 130.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMAND_MODULES = (
    "duotile.codegen.cli",  # list, build, show
    "duotile.passes.autotune.cli",  # tune
    "duotile.runtime.cli",  # generate
)

EXIT_USAGE = 2  # a mistake in what was asked (argparse uses the same status)
EXIT_INTERNAL = 1  # duotile itself failed
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, except where the default says nothing (None,
    False, an empty list) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == [] or default is argparse.SUPPRESS
                or "(default" in text.lower() or "%(default)" in text):
            return text
        return super()._get_help_string(action)


class SubcommandParser(argparse.ArgumentParser):
    """A sub-command's parser: defaults and ``--debug`` (also accepted after the sub-command)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="on an error, show the Python traceback instead of one line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duotile", formatter_class=HelpFormatter,
                                     description="Kernels for the DeepSeek-V4.1-Flash family, written once in a "
                                     "tile DSL and built for sm90, sm100 and ascend950, and a PyTorch runtime.",
                                     epilog="`duotile COMMAND --help` lists a command's options. A mistake on the "
                                     "command line ends in one line and exit status 2.")
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show the Python traceback instead of one line (also: DUOTILE_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=SubcommandParser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # that area has no commands yet
                continue
            raise
        module.register(subparsers)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the request was wrong (a name, a size, a path), not that duotile failed."""
    from .dsl.errors import DslError  # LoweringError, CapacityError, ... derive from it

    # OSError: FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, a full disk
    kinds: list[type[BaseException]] = [DslError, ValueError, KeyError, OSError]
    for module, names in (("duotile.runtime.config", ("ConfigError",)), ("duotile.runtime.weights",
                                                                          ("CheckpointError",))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        kinds += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(kinds)


def one_line(err: BaseException) -> str:
    """An exception's message on one line (a KeyError's without the quotes ``str`` adds)."""
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        text = err.args[0]
    elif isinstance(err, OSError) and err.strerror and err.filename:
        text = f"{err.filename}: {err.strerror}"
    else:
        text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False) or os.environ.get("DUOTILE_DEBUG", "") not in ("", "0")
    where = f"duotile {args.command}"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\n{where}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `duotile show ... | head`: the reader left; nothing to say
        try:
            sys.stdout = open(os.devnull, "w")  # the interpreter flushes stdout at exit
        except OSError:
            pass
        return 0
    except Exception as err:
        if debug:
            raise
        if isinstance(err, _user_errors()) or (isinstance(err, RuntimeError) and str(err).strip()):
            print(f"{where}: {one_line(err)}", file=sys.stderr)
            return EXIT_USAGE
        print(f"{where}: internal error: {type(err).__name__}: {one_line(err)} (run again with --debug "
              f"for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
