"""One training run per run directory: a writability check and an exclusive lock.

The lock is an ``fcntl.flock`` on ``RUN_DIR/.lock``, which holds the holder's PID, host, start
time and job (the torch elastic run id its workers see as ``TORCHELASTIC_RUN_ID``: a worker
writes into the run directory's logs only when the lock names its own job, see
:func:`held_by_other_job`). The kernel drops a flock when its process dies, however it dies, so a lock left by
a killed run is recovered by simply taking it again: the file's contents only name the holder
in the message a second run sees. (flock is per open file: a run is locked against every other
process, including a second ``moesaic train`` of the same user; on NFS it is only as good as the
server's lock support.)
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
from pathlib import Path
from types import TracebackType

from moesaic.train.errors import RunDirError

LOCK_NAME = ".lock"


def check_run_dir(run_dir: str) -> Path:
    """Create ``run_dir`` if needed and check that files can be written in it.

    Raises:
        RunDirError: it exists and is not a directory, cannot be created, or is not writable.
    """
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"run_dir {run_dir} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"run_dir {run_dir} cannot be created: {exc.strerror}") from None
    probe = path / f".write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        with probe.open("w") as f:
            f.write("ok\n")
        probe.unlink()
    except OSError as exc:
        raise RunDirError(f"run_dir {run_dir} is not writable: {exc.strerror}") from None
    return path


class RunLock:
    """An exclusive lock on a run directory; use as a context manager.

    Args:
        run_dir: the run directory (must exist).

    Raises (on enter):
        RunDirError: another live process holds the lock (the message names its PID and host).
    """

    def __init__(self, run_dir: str, job: str | None = None) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.job = job
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise RunDirError(
                    f"run_dir {self.path.parent} is in use by another training run "
                    f"({holder}); wait for it to finish or choose another --run-dir"
                ) from None
            raise RunDirError(f"cannot lock {self.path}: {exc.strerror}") from None
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        info = f"pid {os.getpid()} on host {socket.gethostname()}, started {started}"
        info += f"{_JOB}{self.job}\n" if self.job else "\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        # Empty the file first: a reader never sees a released lock naming a live holder.
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def held_by_other_job(run_dir: str, job: str | None) -> bool:
    """True when ``run_dir``'s lock names a job other than ``job`` (another run holds it).

    False when the lock names no job (released, or not taken yet: the rank that takes it may
    not have got there) or when ``job`` is None (not a worker of an elastic job).
    """
    if not job:
        return False
    try:
        text = (Path(run_dir) / LOCK_NAME).read_text(errors="replace")
    except OSError:
        return False
    _, found, holder = text.strip().partition(_JOB)
    return bool(found) and holder != job


_JOB = ", job "


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
