"""Fixtures shared by several test folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_file(tmp_path_factory) -> Path:
    """48 KB of real Python source: learnable within a few steps, and the same on every machine
    with this Python (the training and GPU tests' corpus)."""
    src = Path(json.__file__).parent.parent / "argparse.py"
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(src.read_bytes()[:48_000])
    return path
