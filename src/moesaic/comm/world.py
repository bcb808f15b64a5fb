"""Spawn small gloo worlds in-process: for tests and benchmarks (no torchrun needed).

``run_world(fn, world_size, *args)`` starts ``world_size`` processes with the spawn method,
joins them through a file:// rendezvous in a fresh temporary directory, runs
``fn(rank, world_size, *args)`` in each, and returns the per-rank results in rank order. A worker
that raises makes the call raise ``WorkerError`` carrying that rank's traceback; a world that
does not finish within ``timeout_s`` is killed and reported. ``fn`` must be importable (defined at
module level) and its results picklable.

Every world launcher in moesaic has one signature, the :class:`Launcher` protocol
``run(fn, world_size, *args, timeout_s=...) -> list`` calling ``fn(rank, world_size, *args)``:
:class:`LocalLauncher` (this module, loopback gloo) and
:class:`moesaic.cluster.launcher.ClusterLauncher` / ``EmulatedCluster`` (gloo over an emulated
multi-level network). Code written against ``Launcher`` runs on either.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["Launcher", "LocalLauncher", "WorkerError", "run_world"]


class WorkerError(RuntimeError):
    """A spawned worker failed; the message holds its traceback."""


@runtime_checkable
class Launcher(Protocol):
    """Runs one function on every rank of a fresh world.

    ``run(fn, world_size, *args, timeout_s=...)`` calls ``fn(rank, world_size, *args)`` in
    ``world_size`` processes that share an initialised (gloo) process group and returns the
    results in rank order; it raises if a rank fails or the world does not finish in
    ``timeout_s``. Implementations may take further keyword arguments.
    """

    def run(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = ...
    ) -> list[Any]: ...


@dataclass(kw_only=True, slots=True, frozen=True)
class LocalLauncher:
    """:class:`Launcher` over loopback: :func:`run_world` with fixed settings.

    Attributes:
        pg_timeout_s: Process-group (collective) timeout of the workers.
        threads: Intra-op threads per worker.
        allow_dead: A rank that dies without reporting yields None (fault-injection tests).
    """

    pg_timeout_s: float = 60.0
    threads: int = 1
    allow_dead: bool = False

    def run(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
    ) -> list[Any]:
        """``fn(rank, world_size, *args)`` on a fresh loopback gloo world; results by rank."""
        return run_world(
            fn,
            world_size,
            *args,
            timeout_s=timeout_s,
            pg_timeout_s=self.pg_timeout_s,
            threads=self.threads,
            allow_dead=self.allow_dead,
        )


def _worker(fn, rank, world_size, init_file, args, results, pg_timeout_s, threads):
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        out = fn(rank, world_size, *args)
        # Plain pickle (tensor bytes inline): torch's shared-memory tensor passing would need
        # this process alive after it exits.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        # Exit without tearing down the process group: a peer may already be gone (the
        # dead-peer tests), and a destroy would then block on it.
        results.close()
        results.join_thread()
        os._exit(0)


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
    allow_dead: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on a fresh gloo world; results in rank order.

    With ``allow_dead`` a rank that exits without reporting (a fault-injection test killing it)
    yields None instead of failing the call, and the survivors' results are still collected.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="moesaic-world-") as tmp:
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    r,
                    world_size,
                    os.path.join(tmp, "rdv"),
                    args,
                    results,
                    pg_timeout_s,
                    threads,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(out) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError(
                        f"world of {world_size} did not finish within {timeout_s:g}s; "
                        f"ranks done: {sorted(out)}"
                    )
                try:
                    rank, ok, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs) if p.exitcode is not None and r not in out
                    ]
                    if dead and not allow_dead:
                        raise WorkerError(f"ranks {dead} died without reporting") from None
                    out.update(dict.fromkeys(dead))
                    continue
                if not ok:
                    raise WorkerError(f"rank {rank} failed:\n{payload}")
                out[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [out[r] for r in range(world_size)]
