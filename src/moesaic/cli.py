"""The ``moesaic`` command line: ``moesaic train | generate | prepare | bench | cluster ...``.

Each subsystem owns its subcommands in its own module and exposes ``add_subparser(subparsers)``;
this file only wires them together. Only the module of the command being run is imported: the
others appear in ``moesaic --help`` as one-line stubs. ``moesaic cluster ...`` and
``moesaic taskflow ...`` therefore never import torch (which ``train``'s options need), and a
missing optional extra only affects the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# (module that defines add_subparser(subparsers), ((command, one-line help), ...)): the help
# strings are repeated here so that listing the commands imports none of the modules.
_MODULES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "moesaic.train.cli",
        (
            ("train", "expert-parallel training of an MoE GPT (elastic, checkpointed)"),
            ("generate", "sample text from a trained checkpoint"),
            ("export", "write a checkpoint as a transformers model directory (with its tokenizer)"),
        ),
    ),
    (
        "moesaic.data.cli",
        (("prepare", "tokenize text, JSONL, parquet or a saved dataset into token shards"),),
    ),
    ("moesaic.bench.cli", (("bench", "benchmarks (results as JSON)"),)),
    ("moesaic.cluster.cli", (("cluster", "emulated multi-level cluster in network namespaces"),)),
    ("moesaic.taskflow.cli", (("taskflow", "compile, inspect and check static MoE taskflows"),)),
    (
        "moesaic.simtools.plan_cli",
        (("plan", "rank strategy x schedule x knobs for a model on a cluster (simulator)"),),
    ),
    (
        "moesaic.simtools.simulate_cli",
        (
            ("simulate", "simulate a training iteration on a cluster (per strategy)"),
            ("calibrate", "measure this machine into a simulator profile"),
        ),
    ),
)

# Exit status of a run stopped by Ctrl-C, as a shell reports a SIGINT death (128 + 2).
EXIT_INTERRUPTED = 130


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: the first word that is not an option.

    The top-level parser has no option that takes a value, so this is exactly what argparse will
    pick as the command.
    """
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``moesaic`` parser, with ``command``'s module loaded and the other commands as stubs.

    Args:
        command: the subcommand about to run; ``None`` (listing the commands, or none given)
            imports no subcommand module at all.
    """
    parser = argparse.ArgumentParser(
        prog="moesaic",
        description="Fast distributed Mixture-of-Experts training with expert parallelism.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module, commands in _MODULES:
        if command in {name for name, _ in commands}:
            importlib.import_module(module).add_subparser(sub)
        else:
            for name, help_text in commands:
                sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``moesaic`` on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(argv)
    try:
        args = build_parser(command).parse_args(argv)
        return int(args.func(args) or 0)
    except (ValueError, OSError, RuntimeError) as exc:
        # A user-facing error: one clear line, no traceback wall.
        print(f"moesaic {command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moesaic {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
