"""Collectives with a deadline, and the autograd all-to-all(v) the dispatchers are built from.

Every call is issued asynchronously and waited on with ``collective_timeout_s``: a peer that died
(gloo: connection reset, seen immediately) or never arrives (timeout) becomes a
``CollectiveError`` naming the operation, the rank and the deadline, instead of a hang.
"""

from __future__ import annotations

import datetime
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moesaic.comm.streams import device_streams, standin_streams_enabled


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer died, hung, or took another code path."""


@dataclass(slots=True)
class Traffic:
    """Bytes this process handed to collectives per destination rank, and how many it issued.

    Counted where the collectives are issued (from the tensors and splits actually passed), so it
    is an independent check of every strategy's own ``CommStats`` accounting. An all-reduce or
    all-gather counts its whole input once per peer (the size of the message, not of a
    particular algorithm's traffic).
    """

    peer_bytes_P: list[int] = field(default_factory=list)
    collectives: int = 0

    def snapshot(self) -> tuple[tuple[int, ...], int]:
        return tuple(self.peer_bytes_P), self.collectives


def shortcuts_allowed() -> bool:
    """Whether a set of one process may skip its collectives (copies, no-ops): unless
    ``MOESAIC_NO_SHORTCUTS=1``, under which an initialised world issues every collective even
    for one rank (solo groups become process groups of their own, one-rank gradient buckets
    are all-reduced), so one GPU exercises every NCCL path. The one rule every group, lane and
    bucket reads."""
    return os.environ.get("MOESAIC_NO_SHORTCUTS", "0") in ("", "0")


def wait_work(
    work: Any,
    failed: str,
    timeout_s: float,
    *,
    on_stream: bool = False,
    device: torch.device | None = None,
) -> None:
    """Wait for ``work`` under the deadline; a failure or timeout is a ``CollectiveError``.

    Args:
        work: an async collective's handle (None: nothing to wait for).
        failed: the start of the error message, naming the operation and the rank
            ("dispatch counts failed on rank 0/2 of the expert-parallel group").
        timeout_s: the deadline in force, named in the message.
        on_stream: the work runs on a device stream (NCCL, or a CPU's stand-in): the current
            stream of ``device``'s streams waits (``comm.streams``: on CUDA the host returns
            at once, the deadline being the process group's watchdog; the stand-in blocks the
            host under ``timeout_s``).
        device: the device of the work's tensors (with ``on_stream``).
    """
    if work is None:
        return
    try:
        if on_stream:
            device_streams(device or torch.device("cuda")).wait_work(work, timeout_s)
        else:
            work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # gloo/NCCL report both timeouts and dead peers as this
        raise collective_error(exc, failed, timeout_s) from exc


# NCCL's watchdog wraps its finding in tags and a preamble: "[PG ID 1 PG GUID 3 Rank 1] Process
# group watchdog thread terminated with exception: [Rank 1] Watchdog caught collective operation
# timeout: WorkNCCL(SeqNum=5, OpType=ALLTOALL_BASE, ...) ran for 60012 milliseconds ...".
_WATCHDOG_PREAMBLE = "terminated with exception:"
_TAGS = re.compile(r"^(?:\s*\[[^\]]*\])+\s*")


def failure_cause(exc: BaseException) -> str:
    """What a backend's error says, in one line: its first line without NCCL's watchdog tags
    and preamble (the flight recorder's and watchdog's own finding: the timed-out work and
    its sequence number, or ``ncclRemoteError``), at most 300 characters."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    text = text.split(_WATCHDOG_PREAMBLE, 1)[-1]
    return " ".join(_TAGS.sub("", text).split())[:300] or type(exc).__name__


def collective_error(exc: BaseException, failed: str, timeout_s: float) -> CollectiveError:
    """The one-line root cause of a failed collective, the same on gloo and NCCL: ``failed``
    (the operation and the rank), the deadline, and the backend's cause (``failure_cause``)."""
    return CollectiveError(
        f"{failed} (collective_timeout_s={timeout_s:g}): a peer died, hung, or skipped this "
        f"collective. Cause: {failure_cause(exc)}"
    )


def device_backends(backend: str) -> dict[str, str]:
    """Device type -> backend name of a process group's backend string: ``"gloo"`` ->
    ``{"cpu": "gloo", "cuda": "gloo"}``, ``"cpu:gloo,cuda:nccl"`` -> the pairs as given."""
    backend = str(backend).lower()
    if ":" in backend:
        pairs = (part.strip().split(":", 1) for part in backend.split(",") if part.strip())
        return {device.strip(): name.strip() for device, name in pairs}
    caps = dist.Backend.backend_capability.get(backend, ["cpu"])
    return {device: backend for device in caps}


def control_device_for(backend: str) -> torch.device:
    """Where a group's control-plane tensors (counts, digests, flags) must live: the CPU when
    the group has a CPU backend, else the current accelerator (pure NCCL takes CUDA tensors
    only: a CPU tensor there raises)."""
    return _control_device(device_backends(backend))


def _control_device(devices: dict[str, str]) -> torch.device:
    if "cpu" in devices:
        return torch.device("cpu")
    kind = next(iter(devices))
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and module.is_available() else 0
    return torch.device(kind, index)


def record_collectives() -> _CollectiveRecording:
    """``with record_collectives() as log:`` every collective this process issues through
    ``EPGroup`` (any thread) is appended to ``log`` as ``(global ranks, lane, op, what)``, in
    issue order: what a test compares across ranks (NCCL needs one order on every rank)."""
    return _CollectiveRecording()


class _CollectiveRecording:
    def __enter__(self) -> list[tuple[Any, ...]]:
        from moesaic.comm.groups import registry

        self._registry = registry()
        self._saved = self._registry.log
        self._registry.log = []
        return self._registry.log

    def __exit__(self, *exc: object) -> None:
        self._registry.log = self._saved


class Pending:
    """A collective in flight: ``wait()`` (under the deadline; on a device stream: the
    current stream waits and the host goes on) returns its output; ``done()`` asks without
    blocking (the work's completion event on a device)."""

    __slots__ = ("_failed", "_on_stream", "_output", "_timeout_s", "_work")

    def __init__(
        self, work: Any, output: torch.Tensor, failed: str, timeout_s: float, on_stream: bool
    ) -> None:
        self._work, self._output, self._failed = work, output, failed
        self._timeout_s, self._on_stream = timeout_s, on_stream

    @property
    def on_stream(self) -> bool:
        return self._on_stream

    def done(self) -> bool:
        return self._work is None or bool(self._work.is_completed())

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """``fn()`` once the transfer has completed (host-side works only: a device work's
        future completes at enqueue, so its time is not the transfer's)."""
        if self._work is None or self._on_stream:
            fn()
        else:
            self._work.get_future().add_done_callback(lambda _fut: fn())

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        """The output, once the transfer is done (``timeout_s``: another deadline than the
        group's, for a caller that promised its own)."""
        if self._work is not None:
            deadline = self._timeout_s if timeout_s is None else timeout_s
            wait_work(
                self._work,
                self._failed,
                deadline,
                on_stream=self._on_stream,
                device=self._output.device,
            )
            self._work = None
        return self._output


class EPGroup:
    """A process group (or the trivial group of one process) with a deadline: the one place
    moesaic issues collectives (a test scans the package for any other).

    It knows where tensors must live (``control_device`` for control-plane tensors: the CPU on
    gloo or a ``cpu:gloo,cuda:nccl`` world, the current GPU on a pure NCCL group) and how to
    wait (host wait with the deadline on gloo; a stream wait on NCCL), counts traffic, and
    records the issue order when asked (``record_collectives``).

    Args:
        group: a torch.distributed group; None means the default world when torch.distributed
            is initialised, else a single process.
        timeout_s: deadline of every collective issued through this object.
        lane: the registry lane the group belongs to (``comm.groups.LANES``), for the record.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, timeout_s: float, *, lane: str = "main"
    ) -> None:
        self.timeout_s = timeout_s
        self.active = dist.is_available() and dist.is_initialized()
        if not self.active and group is not None:
            raise ValueError("group was given, but torch.distributed is not initialised")
        self.group = group if self.active else None
        self.size = dist.get_world_size(self.group) if self.active else 1
        self.rank = dist.get_rank(self.group) if self.active else 0
        self.lane = lane
        self.global_ranks: tuple[int, ...] = (
            tuple(dist.get_process_group_ranks(self.group or dist.group.WORLD))
            if self.active
            else (0,)
        )
        self.traffic = Traffic([0] * self.size)
        self._parent: tuple[EPGroup, list[int]] | None = None
        self._backends: dict[str, str] | None = None
        self.trivial = self.size == 1 and (not self.active or shortcuts_allowed())

    @classmethod
    def solo(cls, timeout_s: float) -> EPGroup:
        """The trivial group of this process alone (even when torch.distributed is running)."""
        out = cls.__new__(cls)
        out.timeout_s, out.active, out.group, out.size, out.rank = timeout_s, False, None, 1, 0
        out.lane = "main"
        out.global_ranks = (
            (dist.get_rank(),) if dist.is_available() and dist.is_initialized() else (0,)
        )
        out.traffic = Traffic([0])
        out._parent = None
        out._backends = None
        out.trivial = True
        return out

    # ---- devices and waits ------------------------------------------------------------------
    def _backend_map(self) -> dict[str, str]:
        if self._backends is None:
            self._backends = device_backends(dist.get_backend(self.group)) if self.active else {}
        return self._backends

    @property
    def control_device(self) -> torch.device:
        """Where this group's control-plane tensors live (see the class docstring)."""
        if not self.active:
            return torch.device("cpu")
        return _control_device(self._backend_map())

    def control_tensor(self, data: Any, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``torch.tensor(data)`` on ``control_device`` (created on the host, copied once)."""
        return torch.tensor(data, dtype=dtype).to(self.control_device)

    def backend_of(self, device_type: str) -> str:
        """The backend that carries this group's tensors of ``device_type`` ("gloo" for a
        group of one process)."""
        return self._backend_map().get(device_type, "gloo")

    def on_stream(self, tensor: torch.Tensor) -> bool:
        """Whether a collective of ``tensor`` runs on a device stream (NCCL and the like,
        or a CPU tensor through ``comm.streams``' stand-in): then waits are stream waits and
        completion is an event, not a host callback."""
        kind = tensor.device.type
        if kind == "cpu":  # gloo; the NCCL branches with MOESAIC_STANDIN_STREAMS=1
            return self.active and standin_streams_enabled()
        return self.backend_of(kind) != "gloo"

    # ---- groups -------------------------------------------------------------------------------
    def subgroups(self, rank_lists: list[list[int]], lane: str = "main") -> list[EPGroup]:
        """Groups of ``rank_lists`` (ranks of this group, each holding this rank), from the
        world's registry (``comm.groups``): one per distinct rank set and lane, shared by every
        layer. A collective of the whole world (every rank calls it at the same point, with its
        own lists; the union is created once, in one order): see ``comm.groups``."""
        for ranks in rank_lists:
            if self.rank not in ranks or sorted(set(ranks)) != list(ranks):
                raise ValueError(
                    f"ranks ({ranks}) must be ascending, unique and include {self.rank}"
                )
        if not self.active:
            return [EPGroup.solo(self.timeout_s) for _ in rank_lists]
        sets = [tuple(self.global_ranks[r] for r in ranks) for ranks in rank_lists]
        out = shared_groups(sets, lane, self.timeout_s)
        for child, ranks in zip(out, rank_lists):
            if child.size > 1:
                child._parent = (self, list(ranks))
        return out

    def in_lane(self, lane: str) -> EPGroup:
        """This group's ranks in another lane (a collective of the whole world); traffic
        counts in this group's."""
        return in_lanes([self], lane)[0]

    # ---- accounting ----------------------------------------------------------------------------
    def _count(self, bytes_P: list[int]) -> None:
        self.traffic.collectives += 1
        for p, b in enumerate(bytes_P):
            if p != self.rank:
                self.traffic.peer_bytes_P[p] += b
        if self._parent is not None:  # a subgroup's traffic also counts in its parent's ranks
            parent, ranks = self._parent
            parent._count(
                [0 if r not in ranks else bytes_P[ranks.index(r)] for r in range(parent.size)]
            )

    def _note(self, op: str, what: str) -> None:
        from moesaic.comm.groups import registry

        log = registry().log
        if log is not None:
            log.append((self.global_ranks, self.lane, op, what))

    def count_sent(self, peer: int, nbytes: int) -> None:
        """Count one point-to-point message of ``nbytes`` to ``peer``, sent outside this
        class's collectives (the taskflow runtime's one-sided puts), as one collective."""
        bytes_P = [0] * self.size
        bytes_P[peer] = nbytes
        self._count(bytes_P)

    def _failed(self, what: str) -> str:
        return f"{what} failed on rank {self.rank}/{self.size} of the expert-parallel group"

    def _issue(self, what: str, call: Callable[[], Any]) -> Any:
        """Issue a collective; an error at issue (NCCL: a communicator its watchdog aborted
        after a peer died, ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, see ``comm.world``) is the
        same ``CollectiveError`` as one seen while waiting."""
        try:
            return call()
        except RuntimeError as exc:
            raise collective_error(exc, self._failed(what), self.timeout_s) from exc

    def _wait(self, work: dist.Work | None, what: str, tensor: torch.Tensor) -> None:
        on_stream = self.on_stream(tensor)
        wait_work(
            work, self._failed(what), self.timeout_s, on_stream=on_stream, device=tensor.device
        )

    # ---- collectives ---------------------------------------------------------------------------
    def start_all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        what: str = "all_to_all",
    ) -> Pending:
        """Issue ``all_to_all_single`` (rows split per rank along dim 0) without waiting."""
        if self.trivial:
            output.copy_(input)
            return Pending(None, output, what, self.timeout_s, False)
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        rows_P = input_splits or [input.shape[0] // self.size] * self.size
        self._count([rows * row_bytes for rows in rows_P])
        self._note("all_to_all", what)
        work = self._issue(
            what,
            lambda: dist.all_to_all_single(
                output, input, output_splits, input_splits, group=self.group, async_op=True
            ),
        )
        return Pending(work, output, self._failed(what), self.timeout_s, self.on_stream(input))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None = None,
        input_splits: list[int] | None = None,
        what: str = "all_to_all",
    ) -> torch.Tensor:
        """``dist.all_to_all_single`` under the deadline; rows split per rank along dim 0."""
        return self.start_all_to_all(output, input, output_splits, input_splits, what).wait()

    def start_all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, what: str = ""
    ) -> Pending:
        """Issue an in-place all-reduce of ``tensor`` without waiting."""
        what = what or "all_reduce"
        if self.trivial:
            return Pending(None, tensor, what, self.timeout_s, False)
        self._count([tensor.numel() * tensor.element_size()] * self.size)
        self._note("all_reduce", what)
        work = self._issue(
            what, lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        )
        return Pending(work, tensor, self._failed(what), self.timeout_s, self.on_stream(tensor))

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, what: str = ""
    ) -> torch.Tensor:
        return self.start_all_reduce(tensor, op, what).wait()

    def barrier(self, what: str = "barrier") -> None:
        """Every rank of the group reaches this point (a one-element all-reduce: unlike
        ``dist.barrier`` it waits with the deadline)."""
        self.all_reduce(torch.zeros(1, device=self.control_device), what=what)

    def all_gather_dim0(self, tensor: torch.Tensor, what: str = "all_gather") -> torch.Tensor:
        """Concatenate equal-shaped tensors of all ranks along dim 0, in rank order."""
        out, finish = self.start_all_gather_dim0(tensor, what)
        finish()
        return out

    def start_all_gather_dim0(
        self, tensor: torch.Tensor, what: str = "all_gather"
    ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Issue :meth:`all_gather_dim0` without waiting: ``(out, finish)``; ``out`` is valid
        once ``finish()`` (the wait under the deadline) has returned."""
        if self.trivial:
            return tensor.clone(), lambda: None
        self._count([tensor.numel() * tensor.element_size()] * self.size)
        self._note("all_gather", what)
        out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]))
        # all_gather_single replaces all_gather_into_tensor in newer torch; both exist in 2.4+.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = self._issue(
            what, lambda: gather(out, tensor.contiguous(), group=self.group, async_op=True)
        )
        return out, lambda: self._wait(work, what, tensor)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "send") -> Pending:
        """Point-to-point send of ``tensor`` to rank ``peer`` of this group (counted)."""
        self.count_sent(peer, tensor.numel() * tensor.element_size())
        work = self._issue(
            what, lambda: dist.isend(tensor, dst=self._global(peer), tag=tag, group=self.group)
        )
        return Pending(work, tensor, self._failed(what), self.timeout_s, self.on_stream(tensor))

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "recv") -> Pending:
        """Point-to-point receive into ``tensor`` from rank ``peer`` of this group."""
        work = self._issue(
            what, lambda: dist.irecv(tensor, src=self._global(peer), tag=tag, group=self.group)
        )
        return Pending(work, tensor, self._failed(what), self.timeout_s, self.on_stream(tensor))

    def _global(self, rank: int) -> int:
        """torch's point-to-point calls take global ranks, also on a subgroup."""
        return self.global_ranks[rank]


def shared_groups(global_sets: list[tuple[int, ...]], lane: str, timeout_s: float) -> list[EPGroup]:
    """The registry's groups (``comm.groups``) of ``global_sets`` (global ranks, each holding
    this rank) in ``lane``: a collective of the whole world, every rank with its own sets."""
    from moesaic.comm.groups import registry

    if not (dist.is_available() and dist.is_initialized()):
        return [EPGroup.solo(timeout_s) for _ in global_sets]
    reg = registry()
    world = EPGroup(None, timeout_s)
    singletons = not shortcuts_allowed()
    reg.create(_gather_rank_sets(world, global_sets, lane), lane, timeout_s, singletons=singletons)
    return [
        EPGroup(reg.lookup(s, lane), timeout_s, lane=lane)
        if len(set(s)) > 1 or singletons
        else EPGroup.solo(timeout_s)
        for s in global_sets
    ]


def in_lanes(groups: list[EPGroup], lane: str) -> list[EPGroup]:
    """Each of ``groups``' ranks in ``lane`` (one world collective for all of them); a group's
    traffic in its lane counts in the group's own."""
    out = shared_groups(
        [g.global_ranks for g in groups], lane, min((g.timeout_s for g in groups), default=60.0)
    )
    for child, g in zip(out, groups):
        if child.size > 1:
            child.timeout_s = g.timeout_s
            child._parent = (g, list(range(g.size)))
    return out


def _gather_rank_sets(
    world: EPGroup, sets: list[tuple[int, ...]], lane: str
) -> list[tuple[int, ...]]:
    """Every rank's ``sets`` (global ranks), gathered over the world: each set is a bit mask
    in int64 words of 62 bits (any world size), padded to the longest list."""
    if world.size == 1:
        return sets
    W = world.size
    words = -(-W // 62)
    n = world.all_gather_dim0(world.control_tensor([[len(sets)]]), f"{lane} group counts")
    longest = int(n.max())

    def mask(ranks: tuple[int, ...]) -> list[int]:
        return [sum(1 << (r - 62 * w) for r in ranks if r // 62 == w) for w in range(words)]

    mask_SW = [mask(ranks) for ranks in sets] + [[0] * words] * (longest - len(sets))
    masks = world.all_gather_dim0(
        world.control_tensor([mask_SW]).view(1, longest, words), f"{lane} group rank sets"
    )
    out = set()
    for m_W in masks.reshape(-1, words).tolist():
        ranks = tuple(r for r in range(W) if m_W[r // 62] >> (r % 62) & 1)
        if ranks:
            out.add(ranks)
    return sorted(out)


class _AllToAllV(torch.autograd.Function):
    """Rows to ranks with the given splits; the backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x_MH, group: EPGroup, in_splits, out_splits, what):
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.what = group, in_splits, out_splits, what
        out = x_MH.new_empty((sum(out_splits), *x_MH.shape[1:]))
        return group.all_to_all_single(out, x_MH.contiguous(), out_splits, in_splits, what)

    @staticmethod
    def backward(ctx, grad_out):
        grad_out = grad_out.contiguous()
        grad_in = grad_out.new_empty((sum(ctx.in_splits), *grad_out.shape[1:]))
        ctx.group.all_to_all_single(
            grad_in, grad_out, ctx.in_splits, ctx.out_splits, f"{ctx.what} (backward)"
        )
        return grad_in, None, None, None, None


def all_to_all_v(
    x_MH: torch.Tensor,
    group: EPGroup,
    in_splits: list[int],
    out_splits: list[int],
    what: str = "all_to_all_v",
) -> torch.Tensor:
    """Autograd all-to-all-v: ``in_splits[p]`` rows go to rank p, ``out_splits[p]`` come back."""
    if group.trivial:
        return x_MH
    return _AllToAllV.apply(x_MH, group, list(in_splits), list(out_splits), what)
