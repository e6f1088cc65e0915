"""The `duotile` command. Each area registers its own sub-commands.

A module listed in COMMAND_MODULES exposes ``register(subparsers)``, which adds its
sub-commands with ``set_defaults(func=...)``; ``func(args)`` returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "duotile.codegen.cli",  # list, build, show
    "duotile.passes.autotune.cli",  # tune
    "duotile.runtime.cli",  # generate
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duotile", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # that area has no commands yet
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
