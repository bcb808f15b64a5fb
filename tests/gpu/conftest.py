"""Shared fixtures of the GPU tests (the CUDA ones skip cleanly without a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def data_file(tmp_path_factory) -> Path:
    """48 KB of real Python source (as tests/train's): learnable, the same on every machine."""
    src = Path(json.__file__).parent.parent / "argparse.py"
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(src.read_bytes()[:48_000])
    return path
