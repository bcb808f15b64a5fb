"""The network of an emulated cluster: namespaces, bridges, shaped links, the delay line, teardown.

Usage::

    spec = ClusterSpec.from_toml("examples/clusters/2dc_2node_small.toml")
    with NetworkFabric(spec) as fabric:
        subprocess.run(fabric.exec_argv(0, ["ping", "-c1", fabric.rank_addresses[1]]))

One network namespace per rank (``msc-<run id>-r<k>``, interface ``eth0``) and one fabric
namespace holding every switch; :class:`~moesaic.cluster.launcher.ClusterLauncher` runs jobs on
it and :class:`~moesaic.cluster.netns.EmulatedCluster` is the two together.

Teardown is guaranteed as far as a process can guarantee it: leaving the ``with`` block (normally
or by an exception), ``close()``, interpreter exit (atexit), SIGTERM and SIGHUP (turned into
``SystemExit`` so the ``with`` block unwinds) and SIGINT (``KeyboardInterrupt``, also in a
process started with SIGINT ignored, as ``cmd &`` in a script is) all remove every namespace;
the delay line also exits when the owner dies (parent-death signal and a stdin pipe that reaches
EOF). The owner is recorded before anything is built
(:mod:`moesaic.cluster.lifecycle`), so after a SIGKILL ``moesaic cluster down`` knows the cluster
is stale and removes its namespaces and temporary directory, and never removes a live one.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import moesaic.cluster.lifecycle as lifecycle
import moesaic.cluster.system as system
from moesaic.checks import check_positive
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

__all__ = ["NetworkFabric"]

_FabricT = TypeVar("_FabricT", bound="NetworkFabric")

_DELAYLINE = Path(__file__).with_name("delayline.py")
# Per-namespace sysctls: no IPv6 chatter (router solicitations, DAD) on the emulated links, and
# no TCP slow-start restart after an idle gap, so back-to-back measurements see a warm window.
_SYSCTLS = (
    "net.ipv6.conf.all.disable_ipv6=1",
    "net.ipv6.conf.default.disable_ipv6=1",
    "net.ipv4.tcp_slow_start_after_idle=0",
)


class NetworkFabric:
    """Builds and tears down the network of one emulated cluster.

    Args:
        spec: The cluster to emulate.
        run_id: Six hex digits naming the run's namespaces (random if None).
        mtu_bytes: MTU of the emulated links.
        max_world_size: Refuse bigger clusters (every rank is a process on this machine).
        setup_timeout_s: Bound on building the network and starting the delay line.
        max_lifetime_s: The delay line exits after this long even if nobody tears it down.

    The delay line is tied to the thread that starts it (it exits when that thread does, through
    the parent-death signal): start and use a fabric from one long-lived thread, normally the main
    thread, which is also the only one where SIGTERM/SIGHUP tear it down.
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
        check_positive("setup_timeout_s", setup_timeout_s)
        check_positive("max_lifetime_s", max_lifetime_s)
        self.spec = spec
        self.topology: Topology = build_topology(
            spec, run_id=run_id or secrets.token_hex(3), mtu_bytes=mtu_bytes
        )
        self.setup_timeout_s = setup_timeout_s
        self.max_lifetime_s = max_lifetime_s
        self._tmpdir: str | None = None
        self._delayline: subprocess.Popen | None = None
        self._prev_handlers: dict[signal.Signals, Any] = {}
        self._started = False
        self._closed = False

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

    @property
    def tmpdir(self) -> Path:
        """The run's temporary directory (removed at teardown); the fabric must be started."""
        if self._tmpdir is None or not self.is_up:
            raise ClusterError(f"cluster {self.run_id} is not up")
        return Path(self._tmpdir)

    @property
    def is_up(self) -> bool:
        """Started and not yet closed."""
        return self._started and not self._closed

    def missing_namespaces(self) -> list[str]:
        """This run's namespaces that no longer exist (removed from outside: ``down --force``)."""
        existing = set(system.list_namespaces())
        return [ns for ns in self.topology.namespaces if ns not in existing]

    def __enter__(self: _FabricT) -> _FabricT:
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
            # Owner first: a concurrent `cluster down` must see a live owner before anything exists.
            lifecycle.register(self.run_id)
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        topo = self.topology
        deadline = time.monotonic() + self.setup_timeout_s
        self._tmpdir = tempfile.mkdtemp(prefix=f"msc-{topo.run_id}-")
        lifecycle.register(topo.run_id, tmpdir=self._tmpdir)
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
        config_path = self.tmpdir / "delayline.json"
        config_path.write_text(json.dumps(config))
        log = open(self.tmpdir / "delayline.log", "wb")  # noqa: SIM115 - kept by Popen
        argv = ["ip", "netns", "exec", topo.fabric_ns]
        argv += [sys.executable, "-I", "-S", str(_DELAYLINE), str(config_path)]
        self._delayline = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, start_new_session=True
        )
        log.close()
        line = _read_line(self._delayline.stdout, deadline)
        if line.strip() != b"ready":
            detail = (self.tmpdir / "delayline.log").read_text(errors="replace")[-2000:]
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
        saved: dict[signal.Signals, Any] = {}
        if in_main:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                saved[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            self._before_close()
            self._stop_delayline()
            system.delete_namespaces(list(self.topology.namespaces))
        finally:
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
            lifecycle.unregister(self.run_id)
            atexit.unregister(self.close)
            if in_main:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)
                for sig, handler in self._prev_handlers.items():
                    signal.signal(sig, handler)
            self._prev_handlers.clear()

    def _before_close(self) -> None:
        """Hook for subclasses: stop what runs on the network before it goes."""

    def _install_handlers(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return  # signals can only be handled on the main thread; atexit still applies
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._prev_handlers[sig] = signal.signal(sig, _raise_system_exit)
        if _sigint_dropped():
            self._prev_handlers[signal.SIGINT] = signal.signal(
                signal.SIGINT, signal.default_int_handler
            )

    def _stop_delayline(self) -> None:
        proc = self._delayline
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        stop_process_group(proc)
        self._delayline = None


def _sigint_dropped() -> bool:
    """Whether a SIGINT would be silently dropped: ignored and not blocked in this thread.

    A process started with SIGINT ignored (``cmd &`` in a non-interactive shell, as CI scripts
    and tool wrappers run things) keeps it ignored across exec, and Python then installs no
    ``KeyboardInterrupt`` handler: ``kill -INT`` would leave the cluster up until the job ends.
    While a cluster is up, SIGINT tears it down like SIGTERM, however the process was started.
    Ignored *and* blocked means someone takes it with ``sigwait`` (as
    :func:`moesaic.bench.interrupt.interrupts_to_main_thread` does): left alone.
    """
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        return False
    if hasattr(signal, "pthread_sigmask"):
        return signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, ())
    return True


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


def stop_process_group(proc: Any, *, grace_s: float = 2.0) -> None:
    """SIGTERM the process group of ``proc`` (a ``subprocess.Popen`` or anything with its
    ``pid`` and ``wait``; a session leader, else the process alone), then SIGKILL; reap it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # not (yet) a group leader: a forked worker before setsid
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, sig)
        except PermissionError:
            pass
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
    # Still there after SIGKILL (uninterruptible sleep): carry on with the teardown regardless;
    # deleting the namespaces does not need it gone.
