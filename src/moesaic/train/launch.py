"""Start a training run through torch's elastic launcher (the machinery behind torchrun).

``launch(cfg)`` validates what can be validated in this process (layout, data, checkpoint), so a
mistake is one clear error before any worker starts, then runs ``cfg.nproc`` workers under an
elastic agent on this node: a standalone c10d rendezvous on a free local port, and up to
``cfg.max_restarts`` restarts of the whole group when a worker dies (the workers resume from the
latest checkpoint). Several nodes: run ``torchrun ... -m moesaic.train`` on each (docs/training.md).
With ``--emulate CLUSTER.toml`` the workers run instead in the namespaces of an emulated cluster
(``emulate.py``), with the same lock, error records and root-cause line.

The launcher holds the run directory's lock (``runlock.py``) for the whole run, and turns a
failed worker group into one line: the error of the rank that failed first for a reason of its
own (``errors.pick_root_cause``, from the records ``worker.py`` leaves), with the path of the log
holding its traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from moesaic.checks import check_output_file
from moesaic.train.ckpt_choice import (
    already_has_checkpoints,
    check_resume_step,
    latest_checkpoint,
    newest_intact_checkpoint,
)
from moesaic.train.config import TrainConfig
from moesaic.train.data import load_splits
from moesaic.train.data_source import check_resume_data, data_identity
from moesaic.train.errors import RECORD_KEY, failure_line
from moesaic.train.plan import AUTO, blame_plan, check_plan_fits, cluster_name
from moesaic.train.runlock import RunLock, check_run_dir
from moesaic.train.worker import write_config

# Loggers of the elastic agent and of torch.multiprocessing: they log rendezvous, restarts,
# child tracebacks and "Terminating process ... via signal SIGTERM"; the launcher reports the
# root cause itself, so keep only their critical logs.
_QUIET_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


def validate(cfg: TrainConfig, world_size: int) -> int | None:
    """Raise ValueError / FileNotFoundError for a run that cannot start.

    Returns the step of the checkpoint a ``--resume`` run starts from (None for a fresh run).
    The checkpoint part is only meaningful while holding the run directory's lock.
    """
    validate_config(cfg, world_size)
    return validate_checkpoints(cfg)


def validate_config(cfg: TrainConfig, world_size: int) -> None:
    """The plan, the layout and the data (nothing on disk is created or locked)."""
    from moesaic.comm.world import device_type_for

    applied = check_plan_fits(cfg, world_size, cluster_name(cfg), note=_note)
    try:  # one node: every rank on this host
        cfg.check_world(world_size, device=device_type_for(cfg.backend))
    except ValueError as exc:
        if cfg.plan is None or cfg.plan == AUTO:
            raise
        raise blame_plan(exc, cfg.plan) from None  # a value the plan set may be the cause
    for name in ("trace", "trace_png"):  # writable before the run, not found bad after it
        if getattr(cfg, name) is not None:
            check_output_file(f"--{name.replace('_', '-')}", getattr(cfg, name))
    notes: list[str] = []
    load_splits(cfg.data, cfg.data_max_bytes, cfg.val_fraction, cfg.model.seq_len, notes=notes)
    for line in notes:  # files of --data that were skipped, and why
        print(f"moesaic train: {line}", file=sys.stderr, flush=True)
    if cfg.resume and not Path(cfg.run_dir).is_dir():
        raise ValueError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
    if applied is not None:
        _note(applied)


def _note(line: str) -> None:
    print(f"moesaic train: {line}", file=sys.stderr, flush=True)


def validate_checkpoints(cfg: TrainConfig) -> int | None:
    """The run directory's checkpoints against ``--resume`` (see :func:`validate`)."""
    path = latest_checkpoint(cfg.run_dir)
    if cfg.resume:
        if path is None:
            raise ValueError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
        # A damaged newest checkpoint is passed over (the workers say so when they resume).
        identity = data_identity(cfg.data)

        def same_data(path: Path, meta: dict) -> None:  # before shapes: a tokenizer's vocab is one
            check_resume_data(path, meta, identity, str(cfg.data))

        chosen = newest_intact_checkpoint(cfg.run_dir, cfg.model, check_meta=same_data)
        if chosen is None:
            raise ValueError(f"--resume: no checkpoint in {cfg.run_dir}/checkpoints")
        path, meta, _ = chosen
        check_resume_step(path, meta, cfg.steps)
        return int(meta["step"])
    if path is not None:
        raise ValueError(already_has_checkpoints(cfg.run_dir, path))
    return None


def launch(cfg: TrainConfig) -> dict:
    """Validate, then train with ``cfg.nproc`` local workers; returns rank 0's summary.

    Config and data are checked first (a mistake there creates nothing), then the run directory
    is created, checked writable and locked, and only then are its checkpoints checked, so two
    runs started together cannot both pass.

    Raises:
        ValueError, FileNotFoundError: the run cannot start (nothing was spawned): a bad
            config, data or checkpoint, a run directory that is not writable or is locked.
        RuntimeError: a worker failed after the allowed restarts (the message is its error).
        KeyboardInterrupt: interrupted (Ctrl-C or SIGTERM); the workers were stopped.
    """
    validate_config(cfg, cfg.nproc)
    if cfg.emulate is not None:
        from moesaic.train.emulate import check_can_emulate

        check_can_emulate(cfg)
    check_run_dir(cfg.run_dir)
    job = f"moesaic-{uuid.uuid4().hex[:8]}"  # the workers' TORCHELASTIC_RUN_ID
    with RunLock(cfg.run_dir, job=job):
        start = validate_checkpoints(cfg)
        if start is not None and start == cfg.steps:
            print(
                f"moesaic train: {cfg.run_dir} is already at step {start} = --steps; nothing "
                "to do (pass a larger --steps to train further)",
                file=sys.stderr,
            )
            return {}
        if cfg.emulate is not None:
            from moesaic.train.emulate import run_emulated

            return run_emulated(cfg, job)
        return _run_agent(cfg, job)


def _quiet_torch_loggers() -> None:
    # Torch's elastic modules set a level on each module's own logger (get_logger), so the
    # level of a parent logger does not reach them: set it on every one that exists by now.
    names = [n for n in logging.root.manager.loggerDict if n.startswith(_QUIET_LOGGERS)]
    for name in [*_QUIET_LOGGERS, *names]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _last_attempt_records(log_dir: str) -> dict[int, Any]:
    """Every rank's error record of the last attempt under ``log_dir`` (the agent's logs:
    ``<run id>/attempt_<n>/<local rank>/error.json``), as failures ``pick_root_cause`` reads.

    The agent reports only the workers it saw exit with an error; a rank that failed first but
    was still tearing down when its peer's echo ended (the peer's "Connection closed by peer")
    was stopped by the agent, and its own record, already written, was not in the report
    (seen in 1 of 12 runs of a full-disk test, and 2 of 4 with the EP group on the default
    group). Reading the files gives the first real error whichever rank exited first.
    """
    found: dict[int, Any] = {}
    attempts = sorted(Path(log_dir).glob("*/attempt_*"), key=lambda p: int(p.name[8:] or 0))
    if not attempts:
        return found
    for error_file in attempts[-1].glob("*/error.json"):
        try:
            data = json.loads(error_file.read_text())
            rank = int(error_file.parent.name)
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get(RECORD_KEY), dict):
            continue  # not a worker's own record (torch's, of a crash): the agent reports it
        found[rank] = SimpleNamespace(error_file_data=data, timestamp=data.get("timestamp", 0))
    return found


# The signals torch's agent turns into a shutdown that forwards the same signal: all but SIGINT,
# which _ctrl_c_stops_workers_with_sigterm handles.
_AGENT_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"


@contextlib.contextmanager
def _ctrl_c_stops_workers_with_sigterm() -> Iterator[None]:
    """Torch's agent stops its workers with the signal it got: on a Ctrl-C, SIGINT, which
    interrupts a worker still starting its interpreter or in ``import torch`` with a traceback
    (or "Fatal Python error: init_import_site"). Here a Ctrl-C stops them with SIGTERM, which
    ends a Python process silently wherever it is; the launcher still reports "interrupted"."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stop(signum: int, frame: object) -> None:
        raise SignalException("interrupted (Ctrl-C)", sigval=signal.SIGTERM)

    previous = signal.signal(signal.SIGINT, stop)  # the agent handles the others (_SIGNALS)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_agent(cfg: TrainConfig, job: str) -> dict:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from moesaic.cluster.lifecycle import process_start_ticks
    from moesaic.comm.world import (
        InheritedFd,
        ask_nccl_watchdog_to_clean_up_only,
        forkserver_context,
    )
    from moesaic.train.launched import run_forked

    _quiet_torch_loggers()
    ask_nccl_watchdog_to_clean_up_only()  # the agent hands its workers this environment's value
    # Workers forked from the preloaded server where the platform has one (no worker imports
    # torch and torch._dynamo anew: about 3.5 s of CPU each), else commands.
    forked = forkserver_context() is not None
    # The agent's logs (error records) in a directory of ours, read on failure and removed at
    # the end (torch's default left an empty /tmp/torchelastic_* tree behind every run).
    log_dir = tempfile.mkdtemp(prefix="moesaic-elastic-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.nproc,
        run_id=job,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"timeout": int(max(60, cfg.timeout_s))},
        max_restarts=cfg.max_restarts,
        monitor_interval=0.2,
        start_method="forkserver" if forked else "spawn",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        signals_to_handle=_AGENT_SIGNALS,
    )
    try:
        # Each worker in a session of its own, so a Ctrl-C reaches this launcher alone and
        # stops them without a traceback each (moesaic.train.launched).
        config_file = Path(log_dir) / "config.json"
        write_config(cfg, config_file)
        summary_file = Path(log_dir) / "summary.json"
        with _ctrl_c_stops_workers_with_sigterm():
            if forked:
                me = (os.getpid(), process_start_ticks(os.getpid()))
                std = (InheritedFd(1), InheritedFd(2))  # what a command would inherit
                args: tuple = (str(config_file), str(summary_file), me, dict(os.environ), std)
                elastic_launch(config, run_forked)(*args)
            else:
                args = ("-m", "moesaic.train.launched", *map(str, (config_file, summary_file)))
                elastic_launch(config, sys.executable)(*args, os.getpid())
        if summary_file.is_file():
            return json.loads(summary_file.read_text())
        return {}
    except ChildFailedError as exc:
        failures = {**_last_attempt_records(log_dir), **exc.failures}
        raise RuntimeError(failure_line(failures, cfg.max_restarts)) from None
    except Exception as exc:
        stopped = _signal_behind(exc, SignalException)
        if stopped is None:
            raise
        if stopped.sigval in (signal.SIGINT, signal.SIGTERM):
            raise KeyboardInterrupt from None
        raise RuntimeError(f"stopped by signal {stopped.sigval.name}") from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def _signal_behind(exc: BaseException, signal_type: type) -> Any:
    """The ``signal_type`` exception that ``exc`` is or was raised while handling, else None.

    A signal's exception is raised wherever the agent happens to be. Torch's metrics wrapper
    around the agent's methods sets its start time inside its ``try``; a signal that lands on
    that line makes the wrapper's ``finally`` raise ``UnboundLocalError`` (its ``start``),
    with the signal's exception only as its context (seen once in a CI run of a Ctrl-C test). The
    agent has stopped its workers either way; the launcher reports the signal."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, signal_type):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
