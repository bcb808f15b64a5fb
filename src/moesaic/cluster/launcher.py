"""Runs a job on an emulated cluster: one worker process per rank, inside the rank's namespace.

:class:`ClusterLauncher` has the signature of every moesaic world launcher
(:class:`moesaic.comm.world.Launcher`): ``run(fn, world_size, *args, timeout_s=...)`` calls
``fn(rank, world_size, *args)`` on every rank with a gloo process group already initialised and
returns the results in rank order. Here the group runs over the emulated network (TCP rendezvous
on rank 0's emulated address, ``GLOO_SOCKET_IFNAME=eth0``), so the job's bytes cross the shaped
links; :class:`moesaic.comm.world.LocalLauncher` runs the same function on loopback.

``fn`` must be importable by reference (a module-level function) and its result picklable.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moesaic.checks import check_positive, check_positive_int
from moesaic.cluster.fabric import NetworkFabric, stop_process_group
from moesaic.cluster.lifecycle import process_start_ticks
from moesaic.cluster.system import ClusterError, ClusterTimeout
from moesaic.cluster.topology import RANK_IFNAME
from moesaic.cluster.worker import NETNS_DIR, run_forked

__all__ = ["ClusterLauncher"]

_BASE_PORT = 29500
# After one rank fails, the others fail their next collective; give them this long to report.
_FAILURE_GRACE_S = 5.0


class ClusterLauncher:
    """Launches jobs on a started :class:`~moesaic.cluster.fabric.NetworkFabric`.

    Args:
        fabric: The network to run on; it must be up when :meth:`run` is called.
    """

    def __init__(self, fabric: NetworkFabric) -> None:
        if not isinstance(fabric, NetworkFabric):
            raise ValueError(f"fabric must be a NetworkFabric, got {type(fabric).__name__}")
        self.fabric = fabric
        self._workers: list[Any] = []  # subprocess.Popen or _ForkedWorker
        self._runs = 0

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout_s: float = 120.0,
        threads: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> list[Any]:
        """Runs ``fn(rank, world_size, *args)`` on every rank; returns the results by rank.

        Each worker has a gloo process group (collective timeout ``timeout_s``) whose rendezvous
        is on rank 0's emulated address, ``GLOO_SOCKET_IFNAME=eth0``, ``torch.set_num_threads
        (threads)``, and the torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``) set.

        Args:
            fn: A module-level function ``fn(rank, world_size, *args)``.
            world_size: Must be the cluster's world size (every rank runs the job).
            *args: Passed to ``fn`` (picklable).
            timeout_s: Bound on the whole job and on each collective.
            threads: Intra-op threads per worker.
            env: Extra environment variables for the workers.

        Raises:
            ValueError: If ``world_size`` is not the cluster's, or ``fn`` and its arguments
                cannot be pickled by reference.
            ClusterTimeout: If the ranks do not all finish within ``timeout_s`` (they are killed).
            ClusterError: If a rank fails; the message carries its traceback.
        """
        fabric = self.fabric
        if not fabric.is_up:
            raise ClusterError("run() needs a started cluster: use `with EmulatedCluster(spec)`")
        if world_size != fabric.world_size:
            raise ValueError(
                f"world_size ({world_size!r}) must be the cluster's world size "
                f"({fabric.world_size}): every rank of the emulated cluster runs the job"
            )
        check_positive("timeout_s", timeout_s)
        check_positive_int("threads", threads)
        try:
            payload = pickle.dumps((fn, tuple(args)))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise ValueError(
                f"fn and its arguments must be picklable (a module-level function): {exc}"
            ) from exc
        job_dir = Path(tempfile.mkdtemp(prefix=f"run{self._runs}-", dir=fabric.tmpdir))
        port = _BASE_PORT + self._runs % 1000
        self._runs += 1
        job = {
            "payload": payload,
            "world_size": world_size,
            "master_addr": fabric.rank_addresses[0],
            "master_port": port,
            "timeout_s": float(timeout_s),
            "threads": threads,
            "result_dir": str(job_dir),
        }
        (job_dir / "job.pkl").write_bytes(pickle.dumps(job))
        worker_env = self._worker_env(port, env)
        try:
            for rank in range(world_size):
                self._workers.append(self._spawn_worker(rank, job_dir, worker_env))
            self._wait_workers(job_dir, time.monotonic() + timeout_s, timeout_s)
        finally:
            self.kill_workers()
        return _collect_results(job_dir, world_size)

    def kill_workers(self) -> None:
        """Stops every worker of the current job (their process groups); idempotent."""
        for proc in self._workers:
            stop_process_group(proc, grace_s=0.5)
        self._workers.clear()

    def _worker_env(self, port: int, extra: Mapping[str, str] | None) -> dict[str, str]:
        fabric = self.fabric
        env = dict(os.environ)
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "GLOO_SOCKET_IFNAME": RANK_IFNAME,
                "MASTER_ADDR": fabric.rank_addresses[0],
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(fabric.world_size),
                "LOCAL_WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "MOESAIC_CLUSTER_RUN_ID": fabric.run_id,
            }
        )
        env.update(extra or {})
        return env

    def _spawn_worker(self, rank: int, job_dir: Path, env: dict[str, str]) -> Any:
        """Rank ``rank``'s worker: forked from the preloaded server into its namespace where
        there is one (:class:`_ForkedWorker`), else a fresh interpreter under ``ip netns
        exec``."""
        env = {**env, "RANK": str(rank), "GROUP_RANK": str(rank)}
        from moesaic.comm.world import forkserver_context

        namespace = self.fabric.topology.rank_ns[rank]
        ctx = forkserver_context()
        if ctx is not None and os.path.exists(os.path.join(NETNS_DIR, namespace)):
            proc = ctx.Process(
                target=run_forked,
                args=(
                    namespace,
                    str(job_dir / "job.pkl"),
                    rank,
                    env,
                    str(job_dir / f"log-{rank}.txt"),
                    (os.getpid(), process_start_ticks(os.getpid())),
                ),
                daemon=False,
            )
            proc.start()
            return _ForkedWorker(proc)
        argv = self.fabric.exec_argv(rank, [sys.executable, "-m", "moesaic.cluster.worker"])
        argv += [str(job_dir / "job.pkl"), str(rank)]
        with open(job_dir / f"log-{rank}.txt", "wb") as log:
            return subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_workers(self, job_dir: Path, deadline: float, timeout_s: float) -> None:
        failed_at: float | None = None
        while True:
            codes = [proc.poll() for proc in self._workers]
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(code not in (None, 0) for code in codes):
                failed_at = now
            if now >= deadline or (failed_at is not None and now - failed_at > _FAILURE_GRACE_S):
                if failed_at is None:
                    stuck = [k for k, code in enumerate(codes) if code is None]
                    raise ClusterTimeout(
                        f"ranks {stuck} did not finish within timeout_s ({timeout_s} s); "
                        f"last output of rank {stuck[0]}: {_tail(job_dir, stuck[0])}"
                    )
                break
            time.sleep(0.02)


class _ForkedWorker:
    """A worker forked by the preloaded server, with the ``pid``, ``poll`` and ``wait`` of the
    ``subprocess.Popen`` it stands in for (exit codes alike: ``-N`` for signal ``N``)."""

    def __init__(self, proc: Any) -> None:
        self._proc = proc
        self.pid: int = proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"cluster worker {self.pid}", timeout or 0.0)
        return int(self._proc.exitcode)


def _tail(job_dir: Path, rank: int, max_chars: int = 3000) -> str:
    try:
        return (job_dir / f"log-{rank}.txt").read_text(errors="replace")[-max_chars:]
    except OSError:
        return "(no log)"


def _collect_results(job_dir: Path, world_size: int) -> list[Any]:
    """Per-rank results; one ClusterError listing every rank that failed or left no result."""
    results: list[Any] = []
    errors: list[str] = []
    for rank in range(world_size):
        path = job_dir / f"result-{rank}.pkl"
        if not path.exists():
            errors.append(
                f"rank {rank} left no result; its output ends with:\n{_tail(job_dir, rank)}"
            )
            results.append(None)
            continue
        status, value = pickle.loads(path.read_bytes())
        if status != "ok":
            errors.append(f"rank {rank} raised:\n{value}")
        results.append(value)
    if errors:
        raise ClusterError(f"{len(errors)} of {world_size} ranks failed\n" + "\n".join(errors))
    return results
