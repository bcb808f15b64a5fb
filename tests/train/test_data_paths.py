"""Odd files in ``--data`` (issue 25 item 1): nothing hangs, only regular files are read, and
the real reason is named.

Before: a named pipe in the data directory blocked the launcher in ``open()`` forever; a
socket, a symlink loop or an unreadable file was reported as "... is empty"; ``--data`` through
a symlink loop said "does not exist"; an unreadable file among good ones was dropped silently.
The hang cases run the loader in a thread with a deadline, so a regression fails instead of
hanging the suite.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path

import pytest
from _train_helpers import tiny_args

from moesaic.cli import main
from moesaic.train.data import load_corpus

TEXT = b"def f(x):\n    return x + 1\n" * 40


def _load(data: Path, notes: list[str] | None = None, deadline_s: float = 10.0) -> bytes:
    """``load_corpus`` under a deadline: a blocked ``open`` is a failure, not a hang."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = load_corpus(str(data), 1 << 20, notes=notes)
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    assert not t.is_alive(), f"load_corpus({data}) blocked for {deadline_s} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def good(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.py").write_bytes(TEXT)
    return d


def test_fifo_in_the_directory_is_skipped_and_said(good):
    os.mkfifo(good / "pipe")
    notes: list[str] = []
    assert _load(good, notes).startswith(TEXT)
    assert len(notes) == 1 and "skipped 1 of 2 files" in notes[0], notes
    assert "not a regular file (a named pipe)" in notes[0] and "pipe" in notes[0]


def test_data_path_that_is_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(
        ValueError, match=r"must be a regular file or a directory, not a named pipe"
    ):
        _load(tmp_path / "pipe")


def test_only_odd_files_names_each_reason(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    os.mkfifo(d / "pipe")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / "sock"))
    (d / "loop").symlink_to(d / "loop")
    (d / "gone").symlink_to(d / "nowhere")
    try:
        with pytest.raises(ValueError) as exc:
            _load(d)
    finally:
        sock.close()
    msg = str(exc.value)
    assert "skipped 4 of 4 files" in msg and "nothing left to train on" in msg, msg
    for why in ("a named pipe", "a socket", "a symlink loop", "a dangling link"):
        assert why in msg, (why, msg)
    assert "is empty" not in msg


def test_data_path_through_a_symlink_loop_names_the_loop(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ValueError, match="cannot be read: a symlink loop"):
        _load(tmp_path / "loop")


def test_unreadable_file_is_skipped_with_permission_denied(good, monkeypatch):
    # The tests may run as root, which chmod cannot stop: refuse the open itself.
    (good / "secret.py").write_bytes(TEXT)
    real_open = os.open

    def deny(path, flags, *args, **kwargs):
        if str(path).endswith("secret.py"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    notes: list[str] = []
    _load(good, notes)
    assert len(notes) == 1 and "1 permission denied" in notes[0] and "secret.py" in notes[0]


def test_train_says_what_it_skipped(good, tmp_path, capfd):
    """The launcher prints the one line before training on the rest."""
    os.mkfifo(good / "pipe")
    assert main(tiny_args(good, tmp_path / "run", "--steps", "2", "--eval-every", "2")) == 0
    err = capfd.readouterr().err
    line = f"moesaic train: data path {good}: skipped 1 of 2 files: 1 not a regular file"
    assert line in err, err
