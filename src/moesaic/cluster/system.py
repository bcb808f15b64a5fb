"""Thin, bounded wrappers around ``ip``/``tc`` and the discovery of leftover namespaces.

Every command runs with a timeout and raises :class:`ClusterError` with its stderr on failure.
Nothing here touches the root namespace's interfaces, routes or qdiscs: commands either create
namespaces or act inside one (``ip -n NS``, ``tc -n NS``, ``ip netns exec NS``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence

from moesaic.cluster.topology import NAME_PREFIX, NAMESPACE_RE, tbf_args

__all__ = [
    "ClusterError",
    "ClusterTimeout",
    "leftover_namespaces",
    "namespace_pids",
    "run_cmd",
    "support_problem",
]

CMD_TIMEOUT_S = 30.0


class ClusterError(RuntimeError):
    """The emulated cluster could not be built, used or torn down."""


class ClusterTimeout(ClusterError):
    """A bounded wait (a command, a worker run, a rendezvous) ran out of time."""


def support_problem(*, probe: bool = False) -> str | None:
    """Why this machine cannot host an emulated cluster, or None if it can.

    Checks for root (network namespaces need CAP_NET_ADMIN; we ask for uid 0 to keep the rule
    simple), for ``ip`` and ``tc`` from iproute2 and for ``/dev/net/tun`` (the delay line's taps).

    Args:
        probe: Also try it: create a throw-away namespace ``msc-000000-r<pid>`` holding a bridge and
            a veth pair shaped by tbf, then delete it (~50 ms). Catches containers that are root
            but may not create namespaces, and kernels without bridges, veth or tbf.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the emulated cluster needs root (CAP_NET_ADMIN) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs '{tool}' from iproute2 on PATH"
    if not os.path.exists("/dev/net/tun"):
        return "the emulated cluster needs /dev/net/tun (tap devices for the delay line)"
    if probe:
        return _probe()
    return None


# The probe's namespaces: run id 000000 (never a run's: ``cluster down`` leaves it), one per
# process (``<prefix><pid>``), so that probes at once (pytest-xdist workers collecting the
# emulated tests together) do not delete each other's namespace midway.
PROBE_PREFIX = f"{NAME_PREFIX}000000-r"


def _probe() -> str | None:
    name = f"{PROBE_PREFIX}{os.getpid()}"
    try:
        pids = {n: n.removeprefix(PROBE_PREFIX) for n in list_namespaces()}
        stale = [  # this process's earlier probe, or one whose process died midway
            n
            for n, pid in pids.items()
            if n.startswith(PROBE_PREFIX) and pid.isdigit() and (n == name or not _alive(int(pid)))
        ]
        if stale:
            delete_namespaces(stale)
        run_cmd(["ip", "netns", "add", name], timeout_s=10.0)
        try:
            batch(
                "ip",
                name,
                ["link add name b type bridge", "link add name v0 type veth peer name v1"],
            )
            run_cmd(["tc", "-n", name, "qdisc", "add", "dev", "v0", "root", *tbf_args(0.1, 1500)])
        finally:
            run_cmd(["ip", "netns", "del", name], timeout_s=10.0)
    except ClusterError as exc:
        return f"this machine cannot build the emulated network: {exc}"
    return None


def require_support() -> None:
    """Raises :class:`ClusterError` naming what is missing if :func:`support_problem` finds it."""
    problem = support_problem()
    if problem is not None:
        raise ClusterError(problem)


def run_cmd(
    argv: Sequence[str], *, stdin: str | None = None, timeout_s: float = CMD_TIMEOUT_S
) -> str:
    """Runs a command to completion; returns stdout; raises ClusterError on failure or timeout."""
    try:
        proc = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ClusterTimeout(f"command {' '.join(argv)!r} did not finish in {timeout_s} s") from exc
    except FileNotFoundError as exc:
        raise ClusterError(f"command {argv[0]!r} not found: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(
            f"command {' '.join(argv)!r} failed (exit {proc.returncode}): "
            + (" | ".join(detail[-5:]) or "no output")
        )
    return proc.stdout


def batch(tool: str, namespace: str | None, lines: Sequence[str], *, force: bool = False) -> None:
    """Runs many ``ip``/``tc`` commands in one process (``-batch -``), optionally inside a ns.

    With ``force``, keeps going past a failing line (and still reports the failure).
    """
    if not lines:
        return
    argv = [tool, *(["-n", namespace] if namespace else []), *(["-force"] if force else [])]
    argv += ["-batch", "-"]
    run_cmd(argv, stdin="\n".join(lines) + "\n")


def list_namespaces() -> list[str]:
    """Names of all network namespaces known to ``ip netns``."""
    out = run_cmd(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftover_namespaces(run_id: str | None = None) -> list[str]:
    """Namespaces created by the harness (``msc-<6 hex>-fab|r<k>``), optionally for one run."""
    names = []
    for name in list_namespaces():
        match = NAMESPACE_RE.match(name)
        if match and (run_id is None or match["run_id"] == run_id):
            names.append(name)
    return names


def namespace_pids(namespace: str) -> list[int]:
    """Processes currently living in ``namespace``."""
    try:
        out = run_cmd(["ip", "netns", "pids", namespace], timeout_s=10.0)
    except ClusterError:
        return []
    return [int(tok) for tok in out.split() if tok.isdigit()]


def kill_pids(pids: Sequence[int], *, grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL what is still alive after ``grace_s`` (bounded wait)."""
    alive = [pid for pid in pids if pid != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if _alive(pid)]
            if alive:
                time.sleep(0.02)
        if not alive:
            return


def _alive(pid: int) -> bool:
    try:
        # Reap it if it is our child; a zombie otherwise counts as alive.
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def delete_namespaces(names: Sequence[str]) -> None:
    """Kills every process inside ``names`` and deletes them (their links and qdiscs go too)."""
    pids = [pid for name in names for pid in namespace_pids(name)]
    if pids:
        kill_pids(pids)
    existing = set(list_namespaces())
    lines = [f"netns del {name}" for name in names if name in existing]
    if lines:
        try:
            batch("ip", None, lines, force=True)
        except ClusterError:
            # A namespace that vanished meanwhile is fine; one that is still there is not.
            remaining = set(names) & set(list_namespaces())
            if remaining:
                raise
