"""Shared runs of the training tests: one tiny reference run reused by most assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _train_helpers import tiny_args

from moesaic.cli import main


@pytest.fixture(scope="session")
def data_file(tmp_path_factory) -> Path:
    # 48 KB of real Python source: learnable within a few steps, and the same on every machine
    # with this Python.
    src = Path(json.__file__).parent.parent / "argparse.py"
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(src.read_bytes()[:48_000])
    return path


@pytest.fixture(scope="session")
def reference(data_file, tmp_path_factory) -> Path:
    """An uninterrupted 8-step run (EP 2, checkpoints at steps 4 and 8)."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert main(tiny_args(data_file, run_dir)) == 0
    return run_dir
