"""Worker entry point: ``python -m moesaic.cluster.worker JOB.pkl RANK`` inside a rank namespace.

Started by :meth:`moesaic.cluster.launcher.ClusterLauncher.run`; not meant to be run by hand:
forked from the preloaded server into the rank's namespace (:func:`run_forked`), or as this
command under ``ip netns exec`` where there is no server. It initialises a gloo process group
over the emulated network (TCP rendezvous on rank 0's address, every collective bounded by the
job's timeout), calls ``fn(rank, world_size, *args)`` and writes ``("ok", value)`` or
``("error", traceback)`` to ``result-<RANK>.pkl`` atomically.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path

from moesaic.cluster.lifecycle import watch_launcher

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000  # <linux/sched.h>
NETNS_DIR = "/run/netns"  # where ``ip netns add`` names its namespaces


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the harness dies, so no worker outlives it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _write_result(result_dir: Path, rank: int, status: str, value: object) -> None:
    tmp = result_dir / f".result-{rank}.tmp"
    try:
        data = pickle.dumps((status, value))
    except Exception as exc:  # an unpicklable return value is the function's bug; report it
        data = pickle.dumps(("error", f"rank {rank}: result is not picklable: {exc!r}"))
    tmp.write_bytes(data)
    os.replace(tmp, result_dir / f"result-{rank}.pkl")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m moesaic.cluster.worker JOB.pkl RANK", file=sys.stderr)
        return 2
    parent_pid = os.getppid()
    _die_with_parent()
    if os.getppid() != parent_pid:
        return 1
    job = pickle.loads(Path(argv[1]).read_bytes())
    rank = int(argv[2])
    result_dir = Path(job["result_dir"])
    import torch
    import torch.distributed as dist

    from moesaic.comm.world import init_world

    torch.set_num_threads(job["threads"])
    try:
        fn, args = pickle.loads(job["payload"])
        init_world(
            device="cpu",
            backend="gloo",
            timeout_s=job["timeout_s"],
            init_method=f"tcp://{job['master_addr']}:{job['master_port']}",
            rank=rank,
            world_size=job["world_size"],
        )
        value = fn(rank, job["world_size"], *args)
    except BaseException:
        _write_result(result_dir, rank, "error", traceback.format_exc())
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    _write_result(result_dir, rank, "ok", value)
    return 0


def _enter_network_namespace(name: str) -> None:
    """This (single-threaded) process joins the network namespace ``ip netns`` calls ``name``;
    every thread it starts afterwards (gloo's) is in it too."""
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def run_forked(
    namespace: str,
    job: str,
    rank: int,
    env: dict[str, str],
    log: str,
    launcher: tuple[int, int | None],
) -> None:
    """A worker forked from the preloaded server (``comm.world.preloaded_context``): what
    ``ip netns exec NAMESPACE python -m moesaic.cluster.worker JOB RANK`` with ``env`` and its
    output to ``log`` in a session of its own does, without a fresh interpreter importing
    torch (about 2 s of CPU a rank); it dies with the ``launcher`` process (pid, start ticks).
    Never returns: exits with :func:`main`'s code."""
    code = 1
    try:
        os.setsid()  # a group of its own, as the launcher stops it (``stop_process_group``)
        watch_launcher(*launcher)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.environ.clear()
        os.environ.update(env)
        _enter_network_namespace(namespace)
        code = main(["worker", job, str(rank)])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
