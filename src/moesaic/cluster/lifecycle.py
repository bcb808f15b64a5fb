"""Who owns an emulated cluster, whether it is still up, and ``cluster down`` that respects it.

Every cluster registers its owner when it starts, before it creates anything: a small JSON record
``<state dir>/<run id>.json`` (``/run/moesaic-cluster`` — tmpfs, emptied at boot like the
namespaces themselves in ``/run/netns`` — or ``$MOESAIC_CLUSTER_STATE_DIR``) naming the owner's
pid and start time, host, command line and temporary directory. The record is removed after the
cluster is torn down.

A run is **live** when its owner process is alive (same pid *and* same start time, so a reused
pid does not count), or, with no record (a run of an older moesaic), when some process still runs
inside its namespaces. ``down`` never touches a live run unless forced by run id, and removes a
stale run's namespaces, temporary directories and record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import moesaic.cluster.system as system
from moesaic.cluster.topology import NAMESPACE_RE

__all__ = [
    "STATE_DIR_ENV",
    "DownReport",
    "Owner",
    "RunStatus",
    "down",
    "read_owner",
    "register",
    "survey",
    "unregister",
]

STATE_DIR_ENV = "MOESAIC_CLUSTER_STATE_DIR"
_DEFAULT_STATE_DIR = "/run/moesaic-cluster"
_RUN_ID_RE = re.compile(r"^[0-9a-f]{6}$")
# tempfile.mkdtemp(prefix="msc-<id>-") names; only directories named so are ever removed.
TMPDIR_RE = re.compile(r"^msc-(?P<run_id>[0-9a-f]{6})-[A-Za-z0-9_]+$")


def state_dir() -> Path:
    """Where owner records live: ``$MOESAIC_CLUSTER_STATE_DIR`` or ``/run/moesaic-cluster``."""
    return Path(os.environ.get(STATE_DIR_ENV) or _DEFAULT_STATE_DIR)


@dataclass(kw_only=True, slots=True, frozen=True)
class Owner:
    """The process that started a cluster.

    Attributes:
        run_id: The cluster's six hex digits.
        pid: Owner process id.
        start_ticks: The owner's start time (``/proc/<pid>/stat`` field 22), to tell a reused pid
            from the owner; None where unknown.
        host: Host name of the owner.
        command: The owner's command line (truncated).
        created: When the record was written (Unix time).
        tmpdir: The run's temporary directory, once created.
    """

    run_id: str
    pid: int
    start_ticks: int | None
    host: str
    command: str
    created: float
    tmpdir: str | None = None

    def alive(self) -> bool:
        """Whether the owner process still runs (a zombie or a reused pid does not count)."""
        ticks = process_start_ticks(self.pid)
        if ticks is None:
            return False
        return self.start_ticks is None or ticks == self.start_ticks


def process_start_ticks(pid: int) -> int | None:
    """Start time of a running, non-zombie process in clock ticks since boot; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 (state); field 22 (starttime) is fields[19]
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def watch_launcher(pid: int, ticks: int | None) -> None:
    """Kills this process's group once the process ``pid`` (started at ``ticks`` clock ticks:
    not a later process given the same pid) is gone, from a daemon thread that looks every
    0.2 s. For a worker forked by a forkserver: its parent is the server, which a killed
    launcher leaves running while any of its workers lives (each holds the server's liveness
    pipe), so the parent-death signal never comes."""
    import signal
    import threading

    def watch() -> None:
        while process_start_ticks(pid) == ticks:
            time.sleep(0.2)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="moesaic-launcher-watch", daemon=True).start()


def _record_path(run_id: str) -> Path:
    if not _RUN_ID_RE.match(run_id):
        raise ValueError(f"run_id ({run_id!r}) must be 6 lowercase hex digits")
    return state_dir() / f"{run_id}.json"


def register(run_id: str, *, tmpdir: str | None = None) -> Owner:
    """Records this process as the owner of ``run_id`` (atomically; rewritten on each call).

    Raises:
        ClusterError: If the state directory cannot be written.
    """
    owner = Owner(
        run_id=run_id,
        pid=os.getpid(),
        start_ticks=process_start_ticks(os.getpid()),
        host=socket.gethostname(),
        command=" ".join(sys.argv)[:200],
        created=time.time(),
        tmpdir=tmpdir,
    )
    path = _record_path(run_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(owner)) + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise system.ClusterError(
            f"cannot record the cluster's owner in {path.parent} ({exc.strerror}); set "
            f"{STATE_DIR_ENV} to a writable directory"
        ) from exc
    return owner


def unregister(run_id: str) -> None:
    """Removes ``run_id``'s owner record (missing is fine)."""
    with contextlib.suppress(FileNotFoundError):
        _record_path(run_id).unlink()


def read_owner(run_id: str) -> Owner | None:
    """``run_id``'s owner record, or None if there is none or it is unreadable."""
    try:
        data = json.loads(_record_path(run_id).read_text())
        return Owner(**data)
    except (OSError, ValueError, TypeError):
        return None


@dataclass(kw_only=True, slots=True)
class RunStatus:
    """What ``down`` knows about one run id.

    Attributes:
        run_id: The run's six hex digits.
        namespaces: Its namespaces (``msc-<id>-fab``, ``msc-<id>-r<k>``) that exist now.
        tmpdirs: Its temporary directories that exist now.
        owner: Its owner record, if any.
        live: Whether it is still up (see the module docstring).
        reason: Why it is (or is not) live, for the user.
    """

    run_id: str
    namespaces: list[str] = field(default_factory=list)
    tmpdirs: list[Path] = field(default_factory=list)
    owner: Owner | None = None
    live: bool = False
    reason: str = ""


def survey(run_id: str | None = None, *, tmp_root: str | Path | None = None) -> list[RunStatus]:
    """Every run found by its namespaces, owner records or temporary directories, sorted by id.

    Args:
        run_id: Only this run.
        tmp_root: Where temporary directories are searched (default ``tempfile.gettempdir()``).
    """
    runs: dict[str, RunStatus] = {}

    def status(rid: str) -> RunStatus:
        return runs.setdefault(rid, RunStatus(run_id=rid))

    for name in system.list_namespaces():
        match = NAMESPACE_RE.match(name)
        if match and match["run_id"] != "000000":  # 000000: support_problem's probe
            status(match["run_id"]).namespaces.append(name)
    records = state_dir()
    if records.is_dir():
        for path in records.glob("*.json"):
            if _RUN_ID_RE.match(path.stem):
                status(path.stem)
    root = Path(tmp_root or tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for path in root.iterdir():
            match = TMPDIR_RE.match(path.name)
            if match and path.is_dir() and not path.is_symlink():
                status(match["run_id"]).tmpdirs.append(path)
    if run_id is not None:
        runs = {run_id: runs.get(run_id, RunStatus(run_id=run_id))}
    for run in runs.values():
        run.owner = read_owner(run.run_id)
        owned = _owned_tmpdir(run)
        if owned is not None and owned not in run.tmpdirs:
            run.tmpdirs.append(owned)
        run.live, run.reason = _liveness(run)
    return [runs[k] for k in sorted(runs)]


def _owned_tmpdir(run: RunStatus) -> Path | None:
    """The record's temp dir if it exists and is named like this run's (never trust a path)."""
    if run.owner is None or not run.owner.tmpdir:
        return None
    path = Path(run.owner.tmpdir)
    match = TMPDIR_RE.match(path.name)
    if match is None or match["run_id"] != run.run_id or path.is_symlink() or not path.is_dir():
        return None
    return path


def _liveness(run: RunStatus) -> tuple[bool, str]:
    owner = run.owner
    if owner is not None:
        who = f"owner pid {owner.pid} on {owner.host} (command: {owner.command})"
        if owner.alive():
            return True, f"still up: {who} is alive"
        return False, f"{who} has exited"
    pids = [pid for ns in run.namespaces for pid in system.namespace_pids(ns)]
    if pids:
        return True, f"owner unknown and {len(pids)} process(es) still run inside its namespaces"
    return False, "no owner record and nothing runs inside"


@dataclass(kw_only=True, slots=True)
class DownReport:
    """What :func:`down` removed and what it kept (run id -> why)."""

    removed_namespaces: list[str] = field(default_factory=list)
    removed_dirs: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """One line for what was removed, one per kept cluster."""
        names = self.removed_namespaces
        out = [f"removed {len(names)} namespace(s)" + (f": {' '.join(names)}" if names else "")]
        if self.removed_dirs:
            out.append(
                f"removed {len(self.removed_dirs)} temp dir(s): {' '.join(self.removed_dirs)}"
            )
        out += [f"kept cluster {rid}: {why}" for rid, why in self.kept.items()]
        return out


def down(
    run_id: str | None = None, *, force: bool = False, tmp_root: str | Path | None = None
) -> DownReport:
    """Removes stale clusters: their namespaces (and every process inside), temp dirs, records.

    Args:
        run_id: Only this run; every stale run if None.
        force: Remove ``run_id`` even if it is still up (its owner will see its network vanish).
            Needs ``run_id``: a live cluster is only ever removed by name.
        tmp_root: Where temporary directories are searched (default ``tempfile.gettempdir()``).

    Returns:
        What was removed and, for each live cluster kept, why.

    Raises:
        ValueError: If ``force`` is given without ``run_id`` or ``run_id`` is malformed.
        ClusterError: Without root or iproute2, or if a namespace cannot be deleted.
    """
    if run_id is not None and not _RUN_ID_RE.match(run_id):
        raise ValueError(f"run_id ({run_id!r}) must be 6 lowercase hex digits")
    if force and run_id is None:
        raise ValueError("force needs a run id: a live cluster is only removed by name")
    system.require_support()
    report = DownReport()
    for run in survey(run_id, tmp_root=tmp_root):
        if run.live and not force:
            hint = f"pass --run-id {run.run_id} --force to remove it anyway"
            report.kept[run.run_id] = f"{run.reason}; {hint}"
            continue
        system.delete_namespaces(run.namespaces)
        report.removed_namespaces += run.namespaces
        for path in run.tmpdirs:
            shutil.rmtree(path, ignore_errors=True)
            report.removed_dirs.append(str(path))
        unregister(run.run_id)
    return report
