"""Torch-free subcommands stay torch-free: ``moesaic cluster ...`` must not pay torch's import.

Each case runs the CLI in a fresh interpreter and reports whether ``torch`` ended up in
``sys.modules`` (before this was fixed, building the top-level parser imported ``train.config`` and
through it ``models.gpt`` and torch, for every subcommand: 3-4 s of a 2-core machine's time).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "2dc_2node_small.toml"

TASKFLOW_SHAPE = ("--experts", "4", "--tokens", "16", "--hidden", "8", "--ffn", "8", "--topk", "2")

# Runs moesaic's main on argv (argv[1:] of this snippet), then prints the exit code and whether
# torch was imported, as JSON on the last line of stdout.
_PROBE = """
import json, sys
from moesaic.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def _probe(*argv: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [
        ("--help",),
        ("cluster", "--help"),
        ("cluster", "down", "--help"),
        ("taskflow", "--help"),
        ("bench", "--help"),
        ("bench", "layer", "--help"),
        ("prepare", "--help"),
        # commands that run, not just print help: both are torch-free work
        ("cluster", "show", "--cluster", str(CLUSTER)),
        ("taskflow", "show", *TASKFLOW_SHAPE),
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_torch_free_commands_do_not_import_torch(argv):
    result = _probe(*argv)
    assert result == {"code": 0, "torch": False}


def test_help_still_lists_every_command(capsys):
    from moesaic.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "generate", "bench", "cluster", "taskflow"):
        assert command in out


def test_unknown_command_is_an_argparse_error(capsys):
    from moesaic.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["nosuch"])
    assert exc.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_train_help_still_has_its_options(capsys):
    from moesaic.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--help"])
    assert exc.value.code == 0
    assert "--checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", "bench", "cluster", "taskflow"])
def test_stub_help_matches_the_command_module(command):
    # `moesaic --help` lists stubs; they must say what the real subparsers say.
    from moesaic.cli import build_parser

    assert build_parser(None).format_help() == build_parser(command).format_help()
