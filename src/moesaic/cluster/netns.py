"""An emulated cluster on one machine: one network namespace per rank, shaped multi-level links.

Usage::

    spec = ClusterSpec.from_toml("examples/clusters/2dc_2node_small.toml")
    with EmulatedCluster(spec) as cluster:
        results = cluster.run(my_module.my_fn, args=(1024,), timeout_s=60)   # one per rank

``my_fn`` runs in one worker process per rank, inside that rank's namespace, with a gloo process
group already initialised over the emulated network (rendezvous on rank 0's emulated address);
it must be importable by reference (a module-level function) and its result picklable.

Teardown is guaranteed as far as a process can guarantee it: leaving the ``with`` block (normally
or by an exception), ``close()``, interpreter exit (atexit), SIGTERM and SIGHUP (turned into
``SystemExit`` so the ``with`` block unwinds) and SIGINT (``KeyboardInterrupt``) all remove every
namespace; the delay line and the workers also exit when the harness dies (parent-death signal
and a stdin pipe that reaches EOF). After a SIGKILL of the harness, ``moesaic cluster down``
removes what is left, found by the ``msc-<run id>-`` name prefix.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from moesaic.cluster import system
from moesaic.cluster.spec import ClusterSpec
from moesaic.cluster.system import ClusterError, ClusterTimeout
from moesaic.cluster.topology import (
    RANK_IFNAME,
    ROOT_BRIDGE,
    Topology,
    build_topology,
    first_rank_address_int,
    tbf_args,
)

__all__ = ["EmulatedCluster"]

_DELAYLINE = Path(__file__).with_name("delayline.py")
_BASE_PORT = 29500
# Per-namespace sysctls: no IPv6 chatter (router solicitations, DAD) on the emulated links, and
# no TCP slow-start restart after an idle gap, so back-to-back measurements see a warm window.
_SYSCTLS = (
    "net.ipv6.conf.all.disable_ipv6=1",
    "net.ipv6.conf.default.disable_ipv6=1",
    "net.ipv4.tcp_slow_start_after_idle=0",
)


class EmulatedCluster:
    """Builds, runs work on, and tears down one emulated cluster.

    Args:
        spec: The cluster to emulate.
        run_id: Six hex digits naming the run's namespaces (random if None).
        mtu_bytes: MTU of the emulated links.
        max_world_size: Refuse bigger clusters (every rank is a process on this machine).
        setup_timeout_s: Bound on building the network and starting the delay line.
        max_lifetime_s: The delay line exits after this long even if nobody tears it down.

    The delay line and the workers are tied to the thread that starts them (they exit when it
    does, through the parent-death signal): start and use a cluster from one long-lived thread,
    normally the main thread, which is also the only one where SIGTERM/SIGHUP tear it down.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        run_id: str | None = None,
        mtu_bytes: int = 9000,
        max_world_size: int = 32,
        setup_timeout_s: float = 60.0,
        max_lifetime_s: float = 6 * 3600.0,
    ) -> None:
        if not isinstance(spec, ClusterSpec):
            raise ValueError(f"spec must be a ClusterSpec, got {type(spec).__name__}")
        if spec.world_size > max_world_size:
            raise ValueError(
                f"world_size ({spec.world_size}) must be at most max_world_size "
                f"({max_world_size}): every rank is a process on this machine"
            )
        if setup_timeout_s <= 0 or max_lifetime_s <= 0:
            raise ValueError("setup_timeout_s and max_lifetime_s must be > 0")
        self.spec = spec
        self.topology: Topology = build_topology(
            spec, run_id=run_id or secrets.token_hex(3), mtu_bytes=mtu_bytes
        )
        self.setup_timeout_s = setup_timeout_s
        self.max_lifetime_s = max_lifetime_s
        self._tmpdir: str | None = None
        self._delayline: subprocess.Popen | None = None
        self._workers: list[subprocess.Popen] = []
        self._prev_handlers: dict[int, Any] = {}
        self._started = False
        self._closed = False
        self._runs = 0

    # --------------------------------------------------------------------------------- basics
    @property
    def run_id(self) -> str:
        return self.topology.run_id

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def delayline_pid(self) -> int | None:
        """Pid of the delay line process while the cluster is up."""
        return self._delayline.pid if self._delayline is not None else None

    @property
    def rank_namespaces(self) -> tuple[str, ...]:
        return self.topology.rank_ns

    @property
    def rank_addresses(self) -> tuple[str, ...]:
        return self.topology.rank_addresses

    def exec_argv(self, rank: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` inside rank ``rank``'s namespace."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank ({rank}) must be in [0, {self.world_size})")
        return ["ip", "netns", "exec", self.topology.rank_ns[rank], *argv]

    def describe(self) -> dict[str, Any]:
        """A JSON-ready description: namespaces, addresses, and links with their rates."""
        topo = self.topology
        return {
            "run_id": topo.run_id,
            "cluster": self.spec.to_dict(),
            "fabric_namespace": topo.fabric_ns,
            "ranks": [
                {"rank": k, "namespace": ns, "address": addr, "interface": RANK_IFNAME}
                for k, (ns, addr) in enumerate(zip(topo.rank_ns, topo.rank_addresses))
            ],
            "links": [
                {
                    "level": link.level,
                    "level_name": self.spec.levels[link.level].name,
                    "group": link.group,
                    "child": f"{link.child_ns}:{link.child_dev}",
                    "parent": f"{topo.fabric_ns}:{link.parent_dev}@{link.parent_bridge}",
                    "bandwidth_gbps": link.bandwidth_gbps,
                }
                for link in topo.links
            ],
            "mtu_bytes": topo.mtu_bytes,
        }

    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- start
    def start(self) -> None:
        """Builds the network. On any failure (or signal) everything built so far is removed."""
        if self._started:
            raise ClusterError(f"cluster {self.run_id} was already started")
        system.require_support()
        self._started = True
        self._install_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        topo = self.topology
        deadline = time.monotonic() + self.setup_timeout_s
        self._tmpdir = tempfile.mkdtemp(prefix=f"msc-{topo.run_id}-")
        system.batch("ip", None, [f"netns add {ns}" for ns in topo.namespaces])
        for ns in topo.namespaces:
            system.run_cmd(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *_SYSCTLS])
        self._start_delayline(deadline)
        self._build_fabric()
        for rank in range(self.world_size):
            self._build_rank(rank)
        self._shape()

    def _start_delayline(self, deadline: float) -> None:
        topo = self.topology
        config = {
            "first_rank_ip": first_rank_address_int(),
            "max_lifetime_s": self.max_lifetime_s,
            "links": [
                {"tap": topo.rank_tap(k), "port": topo.rank_port(k), "delays_ms": topo.delays_ms(k)}
                for k in range(self.world_size)
            ],
        }
        config_path = Path(self._tmpdir) / "delayline.json"
        config_path.write_text(json.dumps(config))
        log = open(Path(self._tmpdir) / "delayline.log", "wb")  # noqa: SIM115 - kept by Popen
        argv = ["ip", "netns", "exec", topo.fabric_ns]
        argv += [sys.executable, "-I", "-S", str(_DELAYLINE), str(config_path)]
        self._delayline = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True
        )
        log.close()
        line = _read_line(self._delayline.stdout, deadline)
        if line.strip() != b"ready":
            detail = (Path(self._tmpdir) / "delayline.log").read_text(errors="replace")[-2000:]
            raise ClusterError(f"the delay line did not start: {line!r} {detail}")

    def _build_fabric(self) -> None:
        topo = self.topology
        mtu = topo.mtu_bytes
        lines = []
        for bridge in topo.bridges:
            # stp_state 0: a tree has no loops, and STP's 15 s forward delay would stall traffic.
            lines.append(f"link add name {bridge} type bridge stp_state 0")
            lines.append(f"link set {bridge} mtu {mtu} up")
        for link in topo.links:
            if link.kind == "veth":
                lines.append(
                    f"link add name {link.child_dev} mtu {mtu} type veth"
                    f" peer name {link.parent_dev} mtu {mtu}"
                )
                lines.append(f"link set {link.child_dev} master {link.child_bridge} up")
            else:  # the rank's tap goes to its namespace; the port stays here
                rank = link.group
                lines.append(f"link set {topo.rank_tap(rank)} netns {topo.rank_ns[rank]}")
                lines.append(f"link set {link.parent_dev} mtu {mtu}")
            lines.append(f"link set {link.parent_dev} master {link.parent_bridge} up")
        lines.append(f"link set {ROOT_BRIDGE} up")
        lines.append("link set lo up")
        system.batch("ip", topo.fabric_ns, lines)

    def _build_rank(self, rank: int) -> None:
        topo = self.topology
        addr = f"{topo.rank_addresses[rank]}/{topo.prefix_len}"
        lines = [
            f"link set {topo.rank_tap(rank)} name {RANK_IFNAME}",
            f"link set {RANK_IFNAME} mtu {topo.mtu_bytes}",
            f"addr add {addr} dev {RANK_IFNAME}",
            f"link set {RANK_IFNAME} up",
            "link set lo up",
        ]
        system.batch("ip", topo.rank_ns[rank], lines)

    def _shape(self) -> None:
        topo = self.topology
        fabric_lines = []
        for link in topo.links:
            args = " ".join(tbf_args(link.bandwidth_gbps, topo.mtu_bytes))
            fabric_lines.append(f"qdisc replace dev {link.parent_dev} root {args}")
            if link.kind == "veth":
                fabric_lines.append(f"qdisc replace dev {link.child_dev} root {args}")
            else:
                system.batch(
                    "tc", link.child_ns, [f"qdisc replace dev {link.child_dev} root {args}"]
                )
        system.batch("tc", topo.fabric_ns, fabric_lines)

    # ---------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Stops every process and removes every namespace of this run (idempotent)."""
        if self._closed or not self._started:
            self._closed = True
            return
        self._closed = True
        # Teardown is short and bounded; a second Ctrl-C or SIGTERM must not cut it in half.
        in_main = threading.current_thread() is threading.main_thread()
        saved = {}
        if in_main:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                saved[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            self._kill_workers()
            self._stop_delayline()
            system.delete_namespaces(list(self.topology.namespaces))
        finally:
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
            atexit.unregister(self.close)
            if in_main:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)
                for sig, handler in self._prev_handlers.items():
                    signal.signal(sig, handler)
            self._prev_handlers.clear()

    def _install_handlers(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return  # signals can only be handled on the main thread; atexit still applies
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._prev_handlers[sig] = signal.signal(sig, _raise_system_exit)

    def _stop_delayline(self) -> None:
        proc = self._delayline
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        _stop_process_group(proc)
        self._delayline = None

    def _kill_workers(self) -> None:
        for proc in self._workers:
            _stop_process_group(proc, grace_s=0.5)
        self._workers.clear()

    # ------------------------------------------------------------------------------------ run
    def run(
        self,
        fn: Callable[..., Any],
        *,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        timeout_s: float = 120.0,
        env: Mapping[str, str] | None = None,
    ) -> list[Any]:
        """Runs ``fn(*args, **kwargs)`` on every rank, one worker process per rank namespace.

        Each worker has a gloo process group (collective timeout ``timeout_s``) whose rendezvous
        is on rank 0's emulated address, ``GLOO_SOCKET_IFNAME=eth0``, and the torchrun-style
        variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) set.

        Returns:
            The per-rank return values, indexed by rank.

        Raises:
            ValueError: If ``fn`` and its arguments cannot be pickled by reference.
            ClusterTimeout: If the ranks do not all finish within ``timeout_s`` (they are killed).
            ClusterError: If a rank fails; the message carries its traceback.
        """
        if not self._started or self._closed:
            raise ClusterError("run() needs a started cluster: use `with EmulatedCluster(spec)`")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        try:
            payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise ValueError(
                f"fn and its arguments must be picklable (a module-level function): {exc}"
            ) from exc
        job_dir = Path(tempfile.mkdtemp(prefix=f"run{self._runs}-", dir=self._tmpdir))
        port = _BASE_PORT + self._runs % 1000
        self._runs += 1
        job = {
            "payload": payload,
            "world_size": self.world_size,
            "master_addr": self.rank_addresses[0],
            "master_port": port,
            "timeout_s": float(timeout_s),
            "result_dir": str(job_dir),
        }
        (job_dir / "job.pkl").write_bytes(pickle.dumps(job))
        worker_env = self._worker_env(port, env)
        try:
            for rank in range(self.world_size):
                self._workers.append(self._spawn_worker(rank, job_dir, worker_env))
            self._wait_workers(job_dir, time.monotonic() + timeout_s, timeout_s)
        finally:
            self._kill_workers()
        return _collect_results(job_dir, self.world_size)

    def _worker_env(self, port: int, extra: Mapping[str, str] | None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "GLOO_SOCKET_IFNAME": RANK_IFNAME,
                "MASTER_ADDR": self.rank_addresses[0],
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "MOESAIC_CLUSTER_RUN_ID": self.run_id,
            }
        )
        env.update(extra or {})
        return env

    def _spawn_worker(self, rank: int, job_dir: Path, env: dict[str, str]) -> subprocess.Popen:
        env = {**env, "RANK": str(rank), "GROUP_RANK": str(rank)}
        argv = self.exec_argv(rank, [sys.executable, "-m", "moesaic.cluster.worker"])
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
                failed_at = now  # the others will fail their next collective; give them 5 s
            if now >= deadline or (failed_at is not None and now - failed_at > 5.0):
                if failed_at is None:
                    stuck = [k for k, code in enumerate(codes) if code is None]
                    raise ClusterTimeout(
                        f"ranks {stuck} did not finish within timeout_s ({timeout_s} s); "
                        f"last output of rank {stuck[0]}: {_tail(job_dir, stuck[0])}"
                    )
                break
            time.sleep(0.02)


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _read_line(stream: Any, deadline: float) -> bytes:
    fd = stream.fileno()
    buf = b""
    while b"\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ClusterTimeout("timed out waiting for the delay line to start")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 256)
            if not chunk:
                break
            buf += chunk
    return buf


def _stop_process_group(proc: subprocess.Popen, *, grace_s: float = 2.0) -> None:
    """SIGTERM the process group of ``proc`` (it is a session leader), then SIGKILL; reap it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
    # Still there after SIGKILL (uninterruptible sleep): carry on with the teardown regardless;
    # deleting the namespaces does not need it gone.


def _tail(job_dir: Path, rank: int, max_chars: int = 3000) -> str:
    try:
        return (job_dir / f"log-{rank}.txt").read_text(errors="replace")[-max_chars:]
    except OSError:
        return "(no log)"


def _collect_results(job_dir: Path, world_size: int) -> list[Any]:
    """Per-rank results; one ClusterError listing every rank that failed or left no result."""
    results, errors = [], []
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
