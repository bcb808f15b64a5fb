"""The ``moesaic`` command line: ``moesaic train | generate | bench | cluster | taskflow ...``.

Each subsystem owns its subcommands in its own module and exposes ``add_subparser(subparsers)``;
this file only wires them together, importing each lazily so that ``moesaic --help`` stays fast
and a missing optional extra only affects the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command, module that defines add_subparser(subparsers))
_COMMANDS = (
    ("train", "moesaic.train.cli"),  # train and generate
    ("bench", "moesaic.bench.cli"),
    ("cluster", "moesaic.cluster.cli"),
    ("taskflow", "moesaic.taskflow.cli"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moesaic",
        description="Fast distributed Mixture-of-Experts training with expert parallelism.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for _name, module in _COMMANDS:
        try:
            importlib.import_module(module).add_subparser(sub)
        except ModuleNotFoundError as exc:
            # Only tolerate the subsystem module itself being absent (not a missing dependency
            # inside it, which is a real error worth a traceback).
            if exc.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        # A user-facing error: one clear line, no traceback wall.
        print(f"moesaic {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
