"""Where a worker writes its traceback when the run directory cannot take it (issue 57 item 5):
a new private file made by mkstemp, never a predictable name in the temp directory that another
local user could pre-create as a link to a file of theirs choosing."""

from __future__ import annotations

import os
import stat

import pytest

from moesaic.train import runlock, worker


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(d))
    return d


def _boom() -> ValueError:
    try:
        raise ValueError("boom 57")
    except ValueError as exc:
        return exc


def test_a_planted_link_at_the_old_name_is_not_followed(tmp_path, temp_dir, monkeypatch):
    monkeypatch.setattr(runlock, "held_by_other_job", lambda run_dir, job: True)
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    # The name the fallback had before: rank, then this process's id.
    (temp_dir / f"moesaic-train-rank_0-{os.getpid()}.log").symlink_to(victim)
    path = worker.write_traceback(str(tmp_path / "run"), 0, _boom())
    assert victim.read_text() == "untouched\n"
    assert path is not None and path.parent == temp_dir and not path.is_symlink()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "ValueError: boom 57" in path.read_text()


def test_the_run_directory_log_is_used_when_it_can_be(tmp_path, temp_dir):
    path = worker.write_traceback(str(tmp_path / "run"), 1, _boom())
    assert path == tmp_path / "run" / "logs" / "rank_1.log"
    assert "ValueError: boom 57" in path.read_text()
    assert not list(temp_dir.iterdir())


def test_an_unwritable_run_directory_falls_back_to_a_private_file(tmp_path, temp_dir):
    run_dir = tmp_path / "run"
    run_dir.write_text("a file, not a directory")  # logs/ cannot be made under it
    path = worker.write_traceback(str(run_dir), 0, _boom())
    assert path is not None and path.parent == temp_dir
    assert path.name.startswith("moesaic-train-rank_0-") and path.suffix == ".log"
    assert "ValueError: boom 57" in path.read_text()
