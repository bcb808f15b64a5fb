"""Spawn small worlds in-process (gloo; CUDA ranks too): for tests and benchmarks (no torchrun).

``run_world(fn, world_size, *args)`` starts ``world_size`` fresh processes
(:func:`preloaded_context`: forked from a server that has imported torch where the platform has
one, else spawned), joins them through a file:// rendezvous in a fresh temporary directory, runs
``fn(rank, world_size, *args)`` in each, and returns the per-rank results in rank order. A worker
that raises makes the call raise ``WorkerError`` carrying that rank's traceback; a world that
does not finish within ``timeout_s`` is killed and reported; one whose process group does not
form (a rank fails before ``fn``) is started afresh, ``WORLD_STARTS`` times in all. ``fn`` must
be importable (defined at module level) and its results picklable.

Every world launcher in moesaic has one signature, the :class:`Launcher` protocol
``run(fn, world_size, *args, timeout_s=...) -> list`` calling ``fn(rank, world_size, *args)``:
:class:`LocalLauncher` (this module, loopback gloo) and
:class:`moesaic.cluster.launcher.ClusterLauncher` / ``EmulatedCluster`` (gloo over an emulated
multi-level network). Code written against ``Launcher`` runs on either.

Every process group moesaic initialises comes from :func:`init_world` (the training loop, the
cluster workers and ``run_world``'s): on a GPU ``cpu:gloo,cuda:nccl`` bound to the local GPU
(``device_id``), so that control-plane tensors on the CPU keep working on every group while the
rows go over NCCL; on the CPU plain gloo. :func:`process_group_args` is that decision alone.
"""

from __future__ import annotations

import datetime
import io
import os
import pickle
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import forkserver
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "BACKENDS",
    "WORLD_STARTS",
    "Launcher",
    "LocalLauncher",
    "WorkerError",
    "init_world",
    "process_group_args",
    "rank_device",
    "run_world",
]

# What a caller may ask for; "auto" and "nccl" on a GPU both mean ``cpu:gloo,cuda:nccl``.
BACKENDS = ("auto", "gloo", "nccl")
# A CUDA world: NCCL for CUDA tensors, gloo for the CPU tensors of the control plane (a pure
# NCCL group raises on a CPU tensor).
CUDA_WORLD_BACKEND = "cpu:gloo,cuda:nccl"


class WorkerError(RuntimeError):
    """A spawned worker failed; the message holds its traceback."""


# What a worker reports with its payload: the result, or the stage a failure happened in.
DONE, JOINING, RUNNING = "done", "joining", "running"
# How many times run_world starts a world whose process group does not form (a gloo mesh
# that cannot connect on a loaded machine: seen once in a full CI run on 2 cores, every rank
# of a 4-rank world refused on loopback for about a minute). fn has not run on the rank that
# reports it, nor on the others: gloo's full mesh needs every pair before any rank goes on.
WORLD_STARTS = 2


def process_group_args(
    *,
    device: torch.device | str,
    timeout_s: float,
    backend: str = "auto",
    store: Any = None,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """The backend string and keyword arguments :func:`init_world` passes to
    ``torch.distributed.init_process_group`` (pure: nothing is initialised).

    Args:
        device: this rank's device: ``cpu``, or ``cuda:<index>`` (the local GPU).
        timeout_s: every collective's deadline (the process group's ``timeout``).
        backend: ``auto`` or ``nccl`` (on a GPU: ``cpu:gloo,cuda:nccl`` with ``device_id``;
            on the CPU ``auto`` is gloo), or ``gloo`` (also with CUDA tensors, which gloo
            moves through the host: several ranks may then share one GPU, which NCCL refuses).
        store, rank, world_size, init_method: the rendezvous, as torch takes them; None leaves
            each to torch (``env://`` under torchrun).

    Raises:
        ValueError: naming the argument and the rule it breaks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend ({backend!r}) must be one of {', '.join(BACKENDS)}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
    if store is not None and init_method is not None:
        raise ValueError("store and init_method cannot both be given (each is a rendezvous)")
    device = torch.device(device)
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    for name, value in (
        ("store", store),
        ("rank", rank),
        ("world_size", world_size),
        ("init_method", init_method),
    ):
        if value is not None:
            kwargs[name] = value
    if device.type == "cpu":
        if backend == "nccl":
            raise ValueError("backend ('nccl') needs a CUDA device; device is cpu")
        return "gloo", kwargs
    if device.type != "cuda":
        raise ValueError(f"device ({device}) must be cpu or cuda:<index>")
    if device.index is None:
        raise ValueError(f"device ({device}) must name its GPU, e.g. cuda:0 (the local rank's)")
    if backend == "gloo":
        return "gloo", kwargs
    # device_id binds the world to this GPU: NCCL creates its communicators for it eagerly
    # instead of guessing the device at the first collective.
    return CUDA_WORLD_BACKEND, {**kwargs, "device_id": device}


# How NCCL's watchdog handles a failed collective (ask_nccl_watchdog_to_clean_up_only).
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def ask_nccl_watchdog_to_clean_up_only() -> None:
    """NCCL's watchdog, finding a collective failed or past its timeout, by default takes the
    process down from its own thread: no Python error, no root-cause line. Clean-up only (2)
    aborts the communicators and lets the next issue or wait raise, which the choke point turns
    into the ``CollectiveError`` line gloo gives. A value already set stays. ``init_world`` asks
    for a CUDA world; torch's elastic agent gives its workers its own environment's value (1
    when unset), so ``moesaic train``'s launcher asks before it starts the agent; a job
    started by ``torchrun`` directly passes ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` itself."""
    os.environ.setdefault(NCCL_ERROR_HANDLING, "2")


def init_world(*, device: torch.device | str, **options: Any) -> torch.device:
    """Initialise this process's torch.distributed world for ``device``; ``options`` are
    :func:`process_group_args`'s (``timeout_s``, ``backend``, the rendezvous). On CUDA,
    ``device`` becomes the current device first. Returns the device."""
    name, kwargs = process_group_args(device=device, **options)
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device ({device}) needs CUDA, which this process does not have")
        torch.cuda.set_device(device)
        ask_nccl_watchdog_to_clean_up_only()
    dist.init_process_group(name, **kwargs)
    _meet()
    return device


def _meet() -> None:
    """Returns once every rank of the new world has formed its gloo mesh.

    ``init_process_group`` can return on one rank while a peer is still connecting: the side
    that opens a pair's connection is done once it has written its greeting, the side that
    accepts it is not until it has read it. A rank that then exits at once (a function with no
    collective, a failing rank) closes the pair under the peer, which fails with "Connection
    closed by peer" (2-rank worlds that exit right after forming: 67 of 150 here, none with this
    meeting). A rank's part of this all-reduce is sent only after its own mesh is formed. The
    tensor is on the CPU, so a CUDA world (``cpu:gloo,cuda:nccl``) meets on gloo and NCCL's
    communicators are left as they are.
    """
    dist.all_reduce(torch.zeros(1))


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
        device: Where each rank runs (``cpu``, ``cuda``), see :func:`run_world`.
        backend: The world's backend (``gloo``, ``auto``, ``nccl``), see :func:`init_world`.
    """

    pg_timeout_s: float = 60.0
    threads: int = 1
    allow_dead: bool = False
    device: str = "cpu"
    backend: str = "gloo"

    def run(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
    ) -> list[Any]:
        """``fn(rank, world_size, *args)`` on a fresh loopback world; results by rank."""
        return run_world(
            fn,
            world_size,
            *args,
            timeout_s=timeout_s,
            pg_timeout_s=self.pg_timeout_s,
            threads=self.threads,
            allow_dead=self.allow_dead,
            device=self.device,
            backend=self.backend,
        )


def device_type_for(backend: str) -> str:
    """The device type a training run with ``backend`` ("auto", "gloo", "nccl") computes on:
    CUDA for NCCL, and for "auto" where CUDA is available; else the CPU."""
    if backend == "nccl" or (backend == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def visible_cuda_device(local_rank: int) -> torch.device:
    """The GPU of the process with ``local_rank`` among the GPUs it can see: ``local_rank``
    modulo the visible count. A scheduler that gives each process its own GPU through
    ``CUDA_VISIBLE_DEVICES`` leaves one visible device to every process, whose index is 0
    whatever ``LOCAL_RANK`` says (``cuda:LOCAL_RANK`` would be "invalid device ordinal")."""
    if local_rank < 0:
        raise ValueError(f"local_rank ({local_rank}) must be >= 0")
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def rank_device(device: str, rank: int) -> torch.device:
    """The device of ``rank`` in a :func:`run_world` of ``device``: ``cpu``; for ``cuda`` GPU
    ``rank % device_count`` (on a one-GPU machine every rank shares it); ``cuda:i`` as given."""
    out = torch.device(device)
    if out.type == "cuda" and out.index is None:
        return visible_cuda_device(rank)
    return out


# What the forkserver imports once, before it forks any world's ranks: torch._dynamo too, which
# the first torch.optim optimizer a process builds imports (its methods are wrapped in
# torch._disable_dynamo): about 1.8 s of CPU in every rank that takes an optimizer step.
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "moesaic.comm.world")


# This process's environment when it imported this module: in a rank forked by the server (which
# preloads this module), the server's environment at its start, so that the rank can tell what
# its starter added to it since (``train.launched.run_forked``).
IMPORT_ENV = dict(os.environ)


class InheritedFd:
    """One of the caller's file descriptors (its standard output or error) handed to a process
    the forkserver forks: pickled as multiprocessing's ``DupFd``, which sends the descriptor
    along with the process, and unpickled as the child's own descriptor (an ``int``). Without
    it a forked process writes where the server's output goes (nowhere: ``preloaded_context``).
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return int(dup.detach())


def take_std(std: tuple[int, int]) -> None:
    """A forked process's standard output and error become ``std`` (descriptors received as
    :class:`InheritedFd`), standard output line-buffered on a terminal as a fresh interpreter's
    would be (the one inherited from the server was set up for /dev/null)."""
    for fd, target in zip(std, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=os.isatty(1))


_server_started_by: int | None = None  # the pid that started the forkserver (this module's)


def preloaded_context() -> Any:
    """The start method of :func:`run_world`'s processes. ``forkserver`` where the platform has
    it: a server process, started once per caller, imports ``FORKSERVER_PRELOAD`` and forks
    each rank from itself, so that a rank starts in tens of ms instead of importing torch
    anew (about 2 s of CPU a rank under ``spawn``; a test suite starts hundreds of worlds).
    The server holds no CUDA context or caller state: a rank sees the same fresh interpreter
    as under ``spawn`` (the caller's ``sys.path`` and working directory, and, passed with each
    world, its environment and standard output and error: :class:`InheritedFd`). ``spawn``
    where there is no forkserver. The emulated cluster's workers and ``moesaic train``'s fork
    from the same server (``cluster.launcher``, ``train.launch``)."""
    global _server_started_by
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # no effect once the server runs
    if _server_started_by != os.getpid() and threading.current_thread() is threading.main_thread():
        _start_server_detached()
        _server_started_by = os.getpid()
    return ctx


def forkserver_context() -> Any:
    """:func:`preloaded_context` when it is the forkserver, else None (the platform has none:
    a launcher then starts its workers as commands)."""
    ctx = preloaded_context()
    return ctx if ctx.get_start_method() == "forkserver" else None


def _start_server_detached() -> None:
    """Starts the forkserver with SIGINT ignored (kept across its exec) and its standard output
    and error on /dev/null. A Ctrl-C in the terminal reaches the caller's whole process group
    and must not interrupt the server inside its imports (a traceback of its own) nor, later,
    the ranks it forks (the caller stops those); and what a child prints before its entry
    point takes the caller's descriptors would otherwise land where the first caller's output
    went (a child forked while a Ctrl-C stops the caller printed its unpickling error there).
    Done once per process: output of the caller's other threads is lost while it runs."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(null, 1)
        os.dup2(null, 2)
        forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)
        signal.signal(signal.SIGINT, previous)


def _worker(
    fn, rank, world_size, init_file, args, results, pg_timeout_s, threads, placement, env, std
):
    # The caller's environment and output now, not the forkserver's at its start.
    os.environ.clear()
    os.environ.update(env)
    take_std(std)
    torch.set_num_threads(threads)
    device, backend = placement
    stage = JOINING  # what a failure is reported as: joining the world, or running fn
    try:
        init_world(
            device=rank_device(device, rank),
            backend=backend,
            timeout_s=pg_timeout_s,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
        )
        stage = RUNNING
        out = fn(rank, world_size, *args)
        # Plain pickle (tensor bytes inline): torch's shared-memory tensor passing would need
        # this process alive after it exits.
        results.put((rank, DONE, pickle.dumps(out)))
    except BaseException:
        results.put((rank, stage, traceback.format_exc()))
    finally:
        # Exit without tearing down the process group: a peer may already be gone (the
        # dead-peer tests), and a destroy would then block on it.
        results.close()
        results.join_thread()
        os._exit(0)


class _NotFormed(WorkerError):
    """A rank could not join the world (its process group did not form); ``fn`` has not run
    on that rank."""


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
    allow_dead: bool = False,
    device: str = "cpu",
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on a fresh world; results in rank order.

    With ``allow_dead`` a rank that exits without reporting (a fault-injection test killing it)
    yields None instead of failing the call, and the survivors' results are still collected.
    ``device`` places each rank (:func:`rank_device`: ``"cuda"`` spreads the ranks over the
    GPUs, all of them on one GPU where there is one) and makes it the current device;
    ``backend`` is :func:`init_world`'s (gloo by default, also with CUDA tensors: several ranks
    can share a GPU over gloo, not over NCCL).

    A world whose process group does not form (a rank fails in :func:`init_world`, before
    ``fn``) is started again with fresh processes and rendezvous, ``WORLD_STARTS`` times in
    all within ``timeout_s``.
    """
    process_group_args(device=rank_device(device, 0), timeout_s=pg_timeout_s, backend=backend)
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, WORLD_STARTS + 1):
        try:
            return _run_once(
                fn,
                world_size,
                args,
                deadline=deadline,
                timeout_s=timeout_s,
                pg_timeout_s=pg_timeout_s,
                threads=threads,
                allow_dead=allow_dead,
                placement=(device, backend),
            )
        except _NotFormed as exc:
            if attempt == WORLD_STARTS:
                raise WorkerError(f"{exc}\n(the world was started {attempt} times)") from None
    raise AssertionError("unreachable")  # internal: the loop returns or raises


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    *,
    deadline: float,
    timeout_s: float,
    pg_timeout_s: float,
    threads: int,
    allow_dead: bool,
    placement: tuple[str, str],
) -> list[Any]:
    """One start of :func:`run_world`'s world (fresh processes and rendezvous), collected until
    ``deadline``; raises ``_NotFormed`` when a rank could not join it."""
    ctx = preloaded_context()
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
                    placement,
                    dict(os.environ),
                    (InheritedFd(1), InheritedFd(2)),
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            while len(out) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError(
                        f"world of {world_size} did not finish within {timeout_s:g}s; "
                        f"ranks done: {sorted(out)}"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs) if p.exitcode is not None and r not in out
                    ]
                    if dead and not allow_dead:
                        raise WorkerError(f"ranks {dead} died without reporting") from None
                    out.update(dict.fromkeys(dead))
                    continue
                if status == JOINING:
                    raise _NotFormed(f"rank {rank} could not join the world:\n{payload}")
                if status != DONE:
                    raise WorkerError(f"rank {rank} failed:\n{payload}")
                out[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return [out[r] for r in range(world_size)]
