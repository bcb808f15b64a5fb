"""Issue 9 (training side): a worker's error reaches the user as one line, the run directory is
checked and locked, Ctrl-C is one line, and a resume past --steps is refused."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from _train_helpers import interrupt_when, read_metrics, start_from, tiny_args

from moesaic.cli import main
from moesaic.train.config import TrainConfig
from moesaic.train.errors import describe, pick_root_cause
from moesaic.train.runlock import RunLock, check_run_dir
from moesaic.train.worker import worker_main


def _one_error_line(err: str) -> str:
    """The single ``moesaic train: error:`` line of ``err``; no traceback anywhere."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, err
    assert lines[0].startswith("moesaic train: error: "), err
    return lines[0]


def test_run_dir_that_is_a_file(data_file, tmp_path, capfd):
    # Issue 9 item 1: `touch f; moesaic train --run-dir f` printed only the other rank's
    # "a peer died ... its error is printed above".
    f = tmp_path / "f"
    f.touch()
    assert main(tiny_args(data_file, f, "--steps", "2")) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert line == f"moesaic train: error: run_dir {f} exists and is not a directory"


def test_bad_config_creates_nothing(data_file, tmp_path, capfd):
    # Config and data are checked before the run directory is created and locked.
    run = tmp_path / "run"
    assert main(tiny_args(data_file, run, "--ep", "3")) == 2
    assert "ep (3) must divide the world size (2)" in _one_error_line(capfd.readouterr().err)
    assert main(tiny_args(data_file, run, "--resume")) == 2
    assert _one_error_line(capfd.readouterr().err).endswith(f"no checkpoint in {run}/checkpoints")
    assert not run.exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only bind mount (root only: chmod does not stop root)."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)
        return
    ok = subprocess.run(["mount", "--bind", str(d), str(d)], capture_output=True).returncode == 0
    ok = ok and subprocess.run(["mount", "-o", "remount,ro,bind", str(d)]).returncode == 0
    if not ok:
        subprocess.run(["umount", str(d)], capture_output=True)
        pytest.skip("cannot make a read-only bind mount here")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=True)


def test_read_only_run_dir(data_file, read_only_dir, capfd):
    assert main(tiny_args(data_file, read_only_dir, "--steps", "2")) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert f"run_dir {read_only_dir} is not writable: " in line
    assert line.endswith(("Read-only file system", "Permission denied")), line


def test_full_disk_while_writing_metrics(data_file, tmp_path, capfd):
    # The run directory passes the up-front check; then metrics.jsonl hits a full disk in
    # rank 0 (/dev/full answers every write with ENOSPC). The user sees rank 0's cause, not
    # rank 1's "a peer died", and the traceback is in the run directory's log.
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to("/dev/full")
    assert main(tiny_args(data_file, run, "--steps", "2", "--max-restarts", "1")) == 2
    err = capfd.readouterr().err
    line = _one_error_line(err)
    log = run / "logs" / "rank_0.log"
    cause = f"rank 0: {run}/metrics.jsonl: No space left on device (traceback in {log})"
    # The first attempt's failure is said once as the group restarts, the last one as the error.
    assert f"moesaic train: {cause}; restarting the workers\n" in err, err
    assert line == f"moesaic train: error: {cause} (the group was restarted 1 time(s) before)"
    assert log.read_text().count("Traceback (most recent call last)") == 2


def test_unexpected_error_is_one_line_with_its_type(tmp_path, monkeypatch, capsys):
    # An IndexError (not one of the "expected" types) used to vanish: now it is one line
    # naming its type, recorded for the launcher, with the traceback in the run directory.
    def boom(cfg):
        return [][1]

    monkeypatch.setattr("moesaic.train.loop.train", boom)
    monkeypatch.setenv("RANK", "1")
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), steps=2)
    with pytest.raises(SystemExit) as info:
        worker_main(cfg, launched=False)
    assert info.value.code == 1
    log = tmp_path / "run" / "logs" / "rank_1.log"
    expected = f"rank 1: IndexError: list index out of range (traceback in {log})"
    assert capsys.readouterr().err == f"moesaic train: error: {expected}\n"
    assert "return [][1]" in log.read_text()
    record = json.loads(error_file.read_text())["moesaic"]
    assert record["line"] == expected and record["peer"] is False
    # Under the moesaic launcher with no restart left, the worker stays quiet (the launcher
    # prints the root cause once).
    with pytest.raises(SystemExit):
        worker_main(cfg, launched=True)
    assert capsys.readouterr().err == ""


def test_root_cause_beats_peer_failures():
    def failure(line=None, peer=False, t=0.0):
        rec = {"moesaic": {"line": line, "peer": peer, "time": t}} if line else {}
        return SimpleNamespace(error_file_data=rec, timestamp=int(t))

    failures = {
        0: failure("rank 0: a peer died", peer=True, t=1.0),
        1: failure("rank 1: disk full", t=2.0),
        2: failure(),  # stopped by the agent: no record
    }
    assert pick_root_cause(failures) == (1, "rank 1: disk full")
    assert pick_root_cause({2: failure(), 3: failure("rank 3: x", peer=True)})[0] == 3
    assert pick_root_cause({2: failure()}) == (2, None)


def test_describe_keeps_one_line():
    assert describe(OSError(28, "No space left on device", "/r/m")) == (
        "/r/m: No space left on device"
    )
    assert describe(ValueError("a\n  b")) == "a b"
    assert describe(KeyError("k")) == "KeyError: 'k'"


def test_second_run_on_a_locked_run_dir(data_file, tmp_path, capfd):
    # Issue 9 item 3: two runs on one run directory both passed validation.
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from moesaic.train.runlock import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(600)",
            str(check_run_dir(str(run))),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(tiny_args(data_file, run, "--steps", "2")) == 2
        line = _one_error_line(capfd.readouterr().err)
        assert f"run_dir {run} is in use by another training run (pid {holder.pid} on host" in line
        assert not (run / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: its lock is stale and is taken over.
    assert f"pid {holder.pid}" in (run / ".lock").read_text()
    with RunLock(str(run)):
        assert f"pid {os.getpid()}" in (run / ".lock").read_text()
    # A lock held in this process (another run) is refused as well.
    with RunLock(str(run)), pytest.raises(ValueError, match="in use by another training run"):
        RunLock(str(run)).acquire()


def test_run_refused_by_the_lock_leaves_the_running_jobs_logs_alone(data_file, tmp_path):
    # Issue 25 item 9: a torchrun refused by the run lock appended its traceback to the running
    # job's logs/rank_0.log (and its other ranks to rank_N.log).
    run = tmp_path / "run"
    logs = run / "logs"
    logs.mkdir(parents=True)
    (logs / "rank_0.log").write_text("the running job's log\n")
    code = (
        "import sys, time; from moesaic.train.runlock import RunLock; "
        "RunLock(sys.argv[1], job='moesaic-running').acquire(); print('locked', flush=True); "
        "time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "2", "-m", "moesaic.train"]
        cmd += [*tiny_args(data_file, run, "--steps", "2", "--timeout-s", "10")[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode != 0
    assert "is in use by another training run" in proc.stderr, proc.stderr[-2000:]
    assert (logs / "rank_0.log").read_text() == "the running job's log\n"
    assert sorted(p.name for p in logs.iterdir()) == ["rank_0.log"]
    # the refused run's traceback went to the temp directory, and its line says where
    assert "(traceback in " + tempfile.gettempdir() in proc.stderr, proc.stderr[-2000:]


def test_lock_names_its_job(tmp_path):
    from moesaic.train.runlock import held_by_other_job

    with RunLock(str(tmp_path), job="moesaic-a"):
        assert "job moesaic-a" in (tmp_path / ".lock").read_text()
        assert held_by_other_job(str(tmp_path), "moesaic-b")
        assert not held_by_other_job(str(tmp_path), "moesaic-a")
        assert not held_by_other_job(str(tmp_path), None)  # not an elastic worker
    assert not held_by_other_job(str(tmp_path), "moesaic-b")  # released: names nobody
    with RunLock(str(tmp_path)):  # a holder without a job (an older moesaic, a script)
        assert not held_by_other_job(str(tmp_path), "moesaic-b")


def test_resume_past_steps(reference, data_file, tmp_path, capfd):
    # `--resume --steps 6` from a step-8 checkpoint exited 0 reporting "-2 this run".
    run = start_from(reference, 8, tmp_path / "a")
    assert main(tiny_args(data_file, run, "--resume", "--steps", "6")) == 2
    line = _one_error_line(capfd.readouterr().err)
    assert line == (
        "moesaic train: error: --resume: checkpoint step_00000008 is at step 8, past --steps 6; "
        "pass --steps greater than 8 to train further"
    )
    # Resuming at exactly --steps: nothing to do, said once, nothing run.
    assert main(tiny_args(data_file, run, "--resume", "--steps", "8")) == 0
    assert "already at step 8 = --steps; nothing to do" in capfd.readouterr().err
    assert not (run / "metrics.jsonl").exists()


@pytest.fixture
def short_tmp():
    """A temp directory with a short path (see :func:`_endless_run`), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="msr-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _endless_run(data_file, tmp_path, stderr, tmp):
    """``moesaic train`` of 100,000 steps in a session of its own (as a terminal's job), with
    its own temp directory ``tmp``; returns the process, that directory and the run directory.
    ``tmp`` is a short path (:func:`short_tmp`): the workers' forkserver puts its socket there,
    and an AF_UNIX path is at most 107 bytes (pytest-xdist's tmp_path is longer)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "moesaic", *tiny_args(data_file, run, "--steps", "100000")]
    proc = subprocess.Popen(
        cmd,
        stderr=stderr,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
        start_new_session=True,
    )
    return proc, tmp, run


def _workers(tmp: Path, launcher: int) -> list[int]:
    """The processes the launcher ``launcher`` started (its workers, and the forkserver they
    are forked from): those whose environment at their start has its ``TMPDIR``."""
    mark = f"TMPDIR={tmp}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == launcher:
            continue
        with contextlib.suppress(OSError):
            if mark in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
    return found


def _gone(tmp: Path, launcher: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while _workers(tmp, launcher):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_ctrl_c_while_the_workers_start_is_one_line(data_file, tmp_path, short_tmp):
    # Issue 25 item 9: a Ctrl-C in a run's first seconds interrupted every worker inside
    # `import torch` (they shared the terminal's process group): 72 lines of tracebacks. The
    # workers now run in sessions of their own; the launcher stops them.
    proc, tmp, _ = _endless_run(data_file, tmp_path, subprocess.PIPE, short_tmp)
    # settle: the workers are inside their imports
    started = lambda: list(tmp.glob("moesaic-elastic-*/config.json"))  # noqa: E731
    err = interrupt_when(proc, started, wait_s=60, settle_s=0.5)
    assert len(err.strip().splitlines()) <= 2, err
    assert not list(tmp.glob("moesaic-elastic-*")), "the agent's files stayed behind"
    assert _gone(tmp, proc.pid), "workers outlived the launcher"


def test_workers_die_with_the_launcher(data_file, tmp_path, short_tmp):
    # Out of the terminal's process group, a worker must still die when its launcher does.
    proc, tmp, run = _endless_run(data_file, tmp_path, subprocess.DEVNULL, short_tmp)
    try:
        deadline = time.monotonic() + 60
        while not all((run / "logs" / f"rank_{r}.log").is_file() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert len(_workers(tmp, proc.pid)) >= 2
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher alone: the workers are elsewhere
        proc.wait()
    assert _gone(tmp, proc.pid), "workers outlived their launcher"


def test_ctrl_c_is_one_line(data_file, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "moesaic", *tiny_args(data_file, run, "--steps", "100000")]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True
    )
    stepped = lambda: (run / "metrics.jsonl").is_file() and read_metrics(run)  # noqa: E731
    interrupt_when(proc, stepped, wait_s=120)
    # The lock went with the run.
    with RunLock(str(run)):
        pass
