"""One worker of a training job, and how its failure reaches the user: one line naming the cause,
the traceback in a log.

Every worker runs under :func:`worker_main`. Whatever it raises (an ``OSError`` writing metrics,
a damaged checkpoint, a peer that died, a bug), the worker

* writes the full traceback to ``RUN_DIR/logs/rank_<R>.log`` (or a file in the temp directory
  when the run directory cannot be written),
* records a one-line description in the elastic agent's error file, marked as a *cause* or as
  a *peer* failure (a collective that failed because another rank died first), and
* exits 1 (130 on Ctrl-C, silently).

The launcher (``launch.py``) then prints the line of the rank that failed first for a reason of
its own (:func:`moesaic.train.errors.pick_root_cause`), so the user sees ``rank 0: cannot write
.../metrics.jsonl: No space left on device`` rather than the other rank's "a peer died". Under ``torchrun`` (no
moesaic launcher) each worker prints its own line.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TextIO

from moesaic.train.errors import RECORD_KEY, CheckpointDamaged, describe, is_peer_failure

if TYPE_CHECKING:
    from moesaic.train.config import TrainConfig

__all__ = ["fail", "read_config", "worker_main", "write_config", "write_traceback"]


def _open_run_dir_log(run_dir: str, rank: int) -> tuple[Path, TextIO] | None:
    """``run_dir/logs/rank_<rank>.log`` opened for appending; None when it cannot be, or when
    another job holds the run directory (a run refused by its lock must not append to the
    running job's logs)."""
    from moesaic.train.runlock import held_by_other_job

    if held_by_other_job(run_dir, os.environ.get("TORCHELASTIC_RUN_ID")):
        return None
    path = Path(run_dir) / "logs" / f"rank_{rank}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path, path.open("a")
    except OSError:
        return None


def _open_temp_log(rank: int) -> tuple[Path, TextIO] | None:
    """A new private file in the temp directory, made by ``mkstemp`` (``O_CREAT | O_EXCL``,
    mode 0600, a random name): a predictable name there could be pre-created by another local
    user as a link to any file, which this process (root, perhaps) would then append to. Its
    path is in the line the user sees."""
    try:
        fd, name = tempfile.mkstemp(prefix=f"moesaic-train-rank_{rank}-", suffix=".log")
    except OSError:
        return None
    return Path(name), os.fdopen(fd, "a")


def _open_log(run_dir: str, rank: int) -> tuple[Path, TextIO] | None:
    return _open_run_dir_log(run_dir, rank) or _open_temp_log(rank)


def write_traceback(run_dir: str, rank: int, exc: BaseException) -> Path | None:
    """Append ``exc``'s traceback to ``run_dir/logs/rank_<rank>.log``; returns the file.

    Falls back to a new private file in the temp directory when the run directory cannot be
    written; None when nothing could be written.
    """
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    header = f"=== {now} host {socket.gethostname()} pid {os.getpid()} attempt {attempt}\n"
    body = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for opened in (_open_run_dir_log(run_dir, rank), None):
        opened = opened or _open_temp_log(rank)
        if opened is None:
            return None
        path, f = opened
        try:  # a full disk fails at the write or the close: then try the temp directory
            with f:
                f.write(header + body)
            return path
        except OSError:
            continue
    return None


def _fault_dumps_to_log(run_dir: str, rank: int) -> TextIO | None:
    """Send faulthandler's dumps (a crash in C++, e.g. gloo aborting while the agent stops
    this rank after a peer failed) to the rank's log instead of the terminal."""
    opened = _open_log(run_dir, rank)
    if opened is None:
        faulthandler.disable()
        return None
    faulthandler.enable(file=opened[1], all_threads=True)
    return opened[1]


def _record(line: str, peer: bool, rank: int) -> None:
    """Leave ``line`` in the elastic agent's error file for the launcher (if there is one)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": line,
        "timestamp": int(time.time()),
        RECORD_KEY: {"line": line, "peer": peer, "rank": rank, "time": time.time()},
    }
    with contextlib.suppress(OSError):  # the launcher then reports the exit code alone
        Path(path).write_text(json.dumps(data))


def fail(
    exc: BaseException, *, run_dir: str, rank: int, launched: bool, restarts_left: int
) -> NoReturn:
    """Report ``exc`` as one line (traceback to a log file) and exit 1.

    Under the moesaic launcher the line goes to the launcher, which prints the root cause once;
    the worker prints it itself only when the group will be restarted (so each failed attempt
    is explained) or when there is no moesaic launcher (torchrun).
    """
    log = write_traceback(run_dir, rank, exc)
    line = f"rank {rank}: {describe(exc)}"
    if log is not None:
        line += f" (traceback in {log})"
    peer = is_peer_failure(exc)
    _record(line, peer, rank)
    if not launched:
        print(f"moesaic train: error: {line}", file=sys.stderr, flush=True)
    elif restarts_left > 0 and not peer:
        print(f"moesaic train: {line}; restarting the workers", file=sys.stderr, flush=True)
    sys.exit(1)


def _rank0_note(rank: int) -> Callable[[str], None]:
    def note(line: str) -> None:
        if rank == 0:
            print(f"moesaic train: {line}", file=sys.stderr, flush=True)

    return note


def write_config(cfg: TrainConfig, path: Path) -> None:
    """The launcher hands its workers the run's config in this one format: ``cfg.to_dict()``
    as JSON (``read_config`` reads it)."""
    path.write_text(json.dumps(cfg.to_dict()))


def read_config(path: str | Path) -> TrainConfig:
    """A launched worker's config, from the file ``write_config`` wrote."""
    from moesaic.train.config import TrainConfig

    return TrainConfig.from_dict(json.loads(Path(path).read_text()))


def worker_main(cfg: TrainConfig, *, launched: bool) -> dict:
    """Run this process's rank of a training job; every failure becomes one line (see above).

    Args:
        cfg: the run's config (under torchrun as its flags made it; under the moesaic launcher
            from its file, ``read_config``).
        launched: True under the moesaic launcher (which holds the run lock and prints the root
            cause); False under torchrun, where rank 0 takes the lock and each rank prints.

    Returns:
        Rank 0's summary (an empty dict on other ranks).
    """
    from moesaic.train.ckpt_choice import check_resume_step, latest_checkpoint, read_checkpoint_meta
    from moesaic.train.loop import train
    from moesaic.train.plan import check_plan_fits, cluster_name
    from moesaic.train.runlock import RunLock, check_run_dir

    rank = int(os.environ.get("RANK", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    run_dir = cfg.run_dir
    restarts_left = max(0, cfg.max_restarts - restart)
    lock = None
    fault_log = _fault_dumps_to_log(run_dir, rank) if launched else None
    try:
        if not launched:  # torchrun: the world is known here (the launcher checked its own)
            world = int(os.environ.get("WORLD_SIZE", "1"))
            note = _rank0_note(rank)
            applied = check_plan_fits(cfg, world, cluster_name(cfg), note=note)
            if applied is not None:
                note(applied)
        if not launched and rank == 0:
            check_run_dir(cfg.run_dir)
            lock = RunLock(cfg.run_dir, job=os.environ.get("TORCHELASTIC_RUN_ID")).acquire()
        path = latest_checkpoint(cfg.run_dir) if cfg.resume else None
        if path is not None:
            with contextlib.suppress(CheckpointDamaged):  # train() goes back to an intact one
                check_resume_step(path, read_checkpoint_meta(path, verify=False), cfg.steps)
        return train(cfg)
    except KeyboardInterrupt:
        # The agent forwards the signal once more while stopping us: not a second traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if not launched:
            print(f"moesaic train: interrupted (rank {rank})", file=sys.stderr, flush=True)
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException as exc:  # every failure becomes one line and a log
        fail(exc, run_dir=run_dir, rank=rank, launched=launched, restarts_left=restarts_left)
    finally:
        if lock is not None:
            lock.release()
        if fault_log is not None:
            faulthandler.disable()
            fault_log.close()
