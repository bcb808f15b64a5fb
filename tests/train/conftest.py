"""Shared runs of the training tests: one tiny reference run reused by most assertions."""

from __future__ import annotations

from pathlib import Path

import pytest
from _train_helpers import tiny_args

from moesaic.cli import main


@pytest.fixture(scope="session")
def reference(data_file, tmp_path_factory) -> Path:
    """An uninterrupted 8-step run (EP 2, checkpoints at steps 4 and 8)."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert main(tiny_args(data_file, run_dir)) == 0
    return run_dir
