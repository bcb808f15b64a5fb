"""``moesaic train --emulate CLUSTER.toml``: the training job on an emulated network.

The launcher (``launch.py``, which has validated the run and holds its lock) builds the
cluster's network (:class:`moesaic.cluster.fabric.NetworkFabric`: one namespace per rank, shaped
links, the delay line) and starts in each rank's namespace the worker command of a normal run,
``python -m moesaic.train.launched CONFIG SUMMARY LAUNCHER_PID``, with the variables torchrun
would set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` =
rank 0's emulated address, ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_ERROR_FILE``) and ``GLOO_SOCKET_IFNAME=eth0``. So
the training loop initialises its gloo world exactly as under torchrun, over the emulated links:
every all-to-all, all-reduce and barrier crosses them. torchrun itself cannot start the workers,
since each rank lives in a namespace of its own.

What the user sees is a normal run's: the rank-0 progress bar and log lines (the workers share
the terminal's output), the run directory with its checkpoints and ``metrics.jsonl``, a failure
as the one line of the rank that failed first for a reason of its own
(:func:`moesaic.train.errors.failure_line`, from the same error records), ``--max-restarts``
restarting the whole group (resuming from the latest checkpoint), and Ctrl-C or SIGTERM stopping
the workers (SIGTERM, in sessions of their own) and tearing the network down before the
"interrupted" line. After a successful run, the bytes every rank's interface sent and received
(the kernel's counters, all attempts together) go to stderr and to ``metrics.jsonl`` as a
``{"kind": "network", ...}`` line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesaic.cluster.fabric import NetworkFabric, stop_process_group
from moesaic.cluster.spec import ClusterSpec
from moesaic.cluster.system import run_cmd, support_problem
from moesaic.cluster.topology import RANK_IFNAME
from moesaic.train.config import TrainConfig
from moesaic.train.errors import RECORD_KEY, failure_line
from moesaic.train.worker import write_config

__all__ = ["check_can_emulate", "network_counters", "run_emulated"]

# The rendezvous port on rank 0's emulated address (a fresh namespace: nothing else listens);
# one per attempt, so a restarted group never meets the previous store in TIME_WAIT.
_BASE_PORT = 29500
# After one rank fails, its peers fail their next collective ("Connection closed by peer");
# give them this long to leave their own records before they are stopped.
_FAILURE_GRACE_S = 5.0
_POLL_S = 0.1


def check_can_emulate(cfg: TrainConfig) -> None:
    """Refuse ``--emulate`` on a machine that cannot build the network (ValueError), before the
    run directory is created or locked."""
    problem = support_problem()
    if problem is not None:
        raise ValueError(f"--emulate {cfg.emulate}: {problem}")


@dataclass(slots=True)
class RankExit:
    """How one rank of an attempt ended, in the shape ``pick_root_cause`` and
    ``failure_line`` read (torch elastic's ``ProcessFailure``)."""

    exitcode: int
    error_file_data: dict[str, Any]
    timestamp: float

    def signal_name(self) -> str:
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"


def run_emulated(cfg: TrainConfig, job: str) -> dict:
    """Train on ``cfg.emulate``'s emulated network; returns rank 0's summary.

    The caller has validated ``cfg`` and holds the run lock (named ``job``).

    Raises:
        RuntimeError: a worker failed after the allowed restarts (its one line), or the
            network could not be built (``ClusterError``).
        KeyboardInterrupt: Ctrl-C or SIGTERM; the workers were stopped, the network removed.
    """
    if cfg.emulate is None:
        raise ValueError("run_emulated needs a run with emulate (--emulate CLUSTER.toml)")
    spec = ClusterSpec.from_toml(cfg.emulate)
    with _signals_as_interrupts(), NetworkFabric(spec) as fabric:
        # Inside the network's own directory (msc-<run id>-*, named in its owner record): it
        # goes with the network, and `moesaic cluster down` removes it once this process is
        # dead (a killed launcher's directory in the temp dir used to stay behind).
        work = Path(tempfile.mkdtemp(prefix="emulate-", dir=fabric.tmpdir))
        config_file = work / "config.json"
        write_config(cfg, config_file)
        summary_file = work / "summary.json"
        for attempt in range(cfg.max_restarts + 1):
            failures = _run_attempt(fabric, cfg, job, attempt, work, config_file, summary_file)
            if not failures:
                break
            if attempt == cfg.max_restarts:
                raise RuntimeError(failure_line(failures, cfg.max_restarts))
        counters = network_counters(fabric)
        summary: dict = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    summary["network"] = _report_network(cfg, spec, counters)
    return summary


def _run_attempt(
    fabric: NetworkFabric,
    cfg: TrainConfig,
    job: str,
    attempt: int,
    work: Path,
    config_file: Path,
    summary_file: Path,
) -> dict[int, RankExit]:
    """One attempt of the whole group; returns the failed ranks (empty when all succeeded)."""
    env = _worker_env(fabric, job, attempt)
    argv = [sys.executable, "-m", "moesaic.train.launched", str(config_file), str(summary_file)]
    argv.append(str(os.getpid()))
    error_files = [
        work / job / f"attempt_{attempt}" / str(k) / "error.json" for k in range(cfg.nproc)
    ]
    procs: list[subprocess.Popen] = []
    try:
        for rank, error_file in enumerate(error_files):
            error_file.parent.mkdir(parents=True)
            rank_env = {**env, "RANK": str(rank), "GROUP_RANK": "0", "LOCAL_RANK": str(rank)}
            rank_env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
            # A session of its own: a Ctrl-C reaches the launcher alone, which stops the
            # workers with SIGTERM (silent wherever a worker is), as the elastic launcher does.
            procs.append(
                subprocess.Popen(
                    fabric.exec_argv(rank, argv),
                    env=rank_env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        codes = _wait(procs)
    finally:  # a worker that exited is reaped already: its pid may belong to another process
        for proc in procs:
            if proc.poll() is None:
                stop_process_group(proc, grace_s=2.0)
    return {
        rank: RankExit(code, _read_record(error_files[rank]), time.time())
        for rank, code in enumerate(codes)
        if code != 0
    }


def _worker_env(fabric: NetworkFabric, job: str, attempt: int) -> dict[str, str]:
    """What torchrun would give a worker of a one-node job, with the rendezvous on rank 0's
    emulated address and gloo bound to the rank's emulated interface."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "GLOO_SOCKET_IFNAME": RANK_IFNAME,
            "MASTER_ADDR": fabric.rank_addresses[0],
            "MASTER_PORT": str(_BASE_PORT + attempt),
            "WORLD_SIZE": str(fabric.world_size),
            # Every rank is a process on this machine: the loop's default threads per worker
            # divide the cores among them.
            "LOCAL_WORLD_SIZE": str(fabric.world_size),
            "TORCHELASTIC_RUN_ID": job,
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "MOESAIC_CLUSTER_RUN_ID": fabric.run_id,
        }
    )
    # c10d warns on every connection that the peer's host name cannot be looked up (a rank's
    # namespace has no resolver: "The hostname of the client socket cannot be retrieved.
    # err=-3"); a user's own TORCH_CPP_LOG_LEVEL is kept.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def _wait(procs: list[subprocess.Popen]) -> list[int]:
    """Every worker's exit code; once one fails, the others get a grace period to fail too
    (their records say whether they are its echo), then are stopped (their code is then the
    signal's, negative)."""
    failed_at: float | None = None
    while True:
        codes = [proc.poll() for proc in procs]
        if all(code is not None for code in codes):
            return [int(code) for code in codes if code is not None]
        now = time.monotonic()
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        if failed_at is not None and now - failed_at > _FAILURE_GRACE_S:
            for proc in procs:
                if proc.poll() is None:
                    stop_process_group(proc, grace_s=2.0)
            return [int(proc.wait()) for proc in procs]
        time.sleep(_POLL_S)


def _read_record(path: Path) -> dict[str, Any]:
    """A worker's error file (``worker.py`` writes it), or {} when it left none."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and isinstance(data.get(RECORD_KEY), dict) else {}


def network_counters(fabric: NetworkFabric) -> list[dict[str, int]]:
    """Bytes each rank's emulated interface sent and received so far (``tx_bytes``,
    ``rx_bytes``), by rank: the kernel's counters of ``eth0`` in the rank's namespace."""
    out = []
    for ns in fabric.rank_namespaces:
        link = json.loads(run_cmd(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", RANK_IFNAME]))
        stats = link[0]["stats64"]
        out.append({"tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"])})
    return out


def _report_network(cfg: TrainConfig, spec: ClusterSpec, counters: list[dict[str, int]]) -> dict:
    """One stderr line and one ``metrics.jsonl`` record of the traffic over the emulated links."""
    tx = [c["tx_bytes"] for c in counters]
    rx = [c["rx_bytes"] for c in counters]
    record = {"kind": "network", "cluster": spec.name, "tx_bytes": tx, "rx_bytes": rx}
    per_rank = ", ".join(f"rank {k} {b / 1e6:.1f}" for k, b in enumerate(tx))
    print(
        f"moesaic train: emulated cluster {spec.name}: the ranks sent {sum(tx) / 1e6:.1f} MB "
        f"over its links ({per_rank} MB)",
        file=sys.stderr,
        flush=True,
    )
    metrics = Path(cfg.run_dir) / "metrics.jsonl"
    try:
        with metrics.open("a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write {metrics}: {exc.strerror}") from None
    return record


@contextlib.contextmanager
def _signals_as_interrupts():
    """SIGTERM ends the run as a Ctrl-C does (the elastic launcher's behaviour): the network
    turns it into ``SystemExit(128 + SIGTERM)`` to unwind; here that becomes KeyboardInterrupt
    once the workers are stopped and the network removed. SIGHUP is "stopped by signal"."""
    try:
        yield
    except SystemExit as exc:
        if exc.code == 128 + signal.SIGTERM:
            raise KeyboardInterrupt from None
        if exc.code == 128 + signal.SIGHUP:
            raise RuntimeError("stopped by signal SIGHUP") from None
        raise
