"""The communication pool of FlowMoE (paper Alg. 2): all-to-alls first, gradient all-reduce in
Sp-byte chunks in the gaps.

Shape legend: N parameters, P ranks.

Two kinds of collective share the network of a rank:

* all-to-alls (the pipeline's D and C stages) are issued at once, when the schedule asks
  (``all_to_all``), on their EP group's ranks in the registry's ``rows`` lane (``comm.groups``),
  so that a strategy's small synchronous exchanges on the ``main`` lane (the dispatch counts)
  never queue behind rows in flight;
* gradient all-reduces run in the ``grad`` lane: one group per distinct reduction rank set,
  shared with every other user of that set and lane.

A gradient enters the pool from a per-parameter post-accumulate hook once its backward over all
R chunks is complete (its hook count reaches the count learned in the first step, which reduces
everything at ``finish``). Where it goes is the gradient layout's (``schedule/grad_layout.py``):
parameters laid out, in the ready order rank 0 saw in the first step, in one flat staging buffer
per (reduction rank set, dtype), cut into chunks of ``chunk_bytes`` (Sp) that form one sequence
every rank issues in the same order. This module issues them.

**Every collective is issued from the schedule's thread, at points of its program order, so
every rank issues the same sequence** (NCCL requires one order on every rank and
communicator; a thread deciding by timing would interleave differently on each rank). The
priority rule of Alg. 2 ("an all-reduce chunk only while no all-to-all is in flight") is
expressed in that order: the schedule waiting for an all-to-all opens a *gap* (the network is
free of that transfer), issuing the next all-to-all closes it, and in each gap at most one
chunk is issued, at its start or at the hook that completes it. On a device the chunk is
enqueued after the stream waited for the all-to-all, so it also starts after it on the GPU.
Once the schedule says its last all-to-all of the step has been issued (``end_all_to_alls``)
and has waited for all of them, nothing is left to protect: every ready chunk goes at once (the
step's tail; what completes there is one chunk per bucket, ``grad_layout.py``). ``finish``
issues the rest, waits each under the deadline, and writes ``sum / divisor`` back to
``p.grad``. A parameter whose gradient never arrived on this rank
reduces zeros, so every rank issues the same chunks. Reduction rank sets of one rank (expert
shards without replicas) are not reduced, only divided (unless the single-rank shortcuts are off,
``MOESAIC_NO_SHORTCUTS=1``: then they are all-reduced over their one-rank group).

Trace spans: on gloo a transfer's span ends when its work completes (the work's future); on a
device stream the future completes at enqueue, so spans are timed by the device's events
(``comm.streams``: CUDA events, or the CPU stand-in's host times) recorded around the transfer
and resolved at ``finish`` (one host synchronisation per step, only when the recorder is
enabled).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moesaic.checks import check_positive, check_positive_int
from moesaic.comm.collectives import EPGroup, Pending, in_lanes, shortcuts_allowed
from moesaic.comm.streams import device_streams
from moesaic.schedule.grad_layout import Chunk, GradLayout

if TYPE_CHECKING:
    from moesaic.schedule.base import GradientSync
    from moesaic.trace import Recorder

__all__ = ["CommPool", "PendingA2A"]


class _DeviceSpans:
    """Spans of transfers on a device stream, timed by events of the device's streams
    (``comm.streams``: CUDA events, or the CPU stand-in's host timestamps): each transfer
    records a start event before it is issued and an end event once the stream waited for it;
    at ``resolve`` the events are turned into host times through one anchor (event, host time)
    taken at the start of the step."""

    def __init__(self) -> None:
        self._anchor: tuple[Any, float] | None = None
        self._open: list[tuple[str, str, Any, Any, dict[str, Any]]] = []

    def begin(self, now: float, device: torch.device) -> None:
        self._anchor, self._open = (self.start(device), now), []

    @staticmethod
    def start(device: torch.device) -> Any:
        ev = device_streams(device).event(timing=True)
        ev.record()
        return ev

    def end(
        self, resource: str, name: str, start: Any, args: dict[str, Any], device: torch.device
    ) -> None:
        self._open.append((resource, name, start, self.start(device), args))

    def resolve(self, recorder: Recorder) -> None:
        if self._anchor is None:
            return
        anchor, t0 = self._anchor
        for resource, name, start, end, args in self._open:
            end.synchronize()
            a = t0 + anchor.elapsed_time(start) / 1e3
            recorder.add(resource, name, a, t0 + anchor.elapsed_time(end) / 1e3, **args)
        self._anchor, self._open = None, []


class PendingA2A:
    """An all-to-all issued by the pool; ``wait()`` returns its output once it has arrived (on
    a device: once the current stream waits for it) and tells the pool a gap opened."""

    def __init__(self, pool: CommPool, pending: Pending, span: Callable[[], None] | None):
        self._pool, self._pending, self._span = pool, pending, span
        self._waited = False

    def wait(self) -> torch.Tensor:
        """The received rows (a ``CollectiveError`` naming the op if the deadline passes)."""
        out = self._pending.wait()
        if not self._waited:
            self._waited = True
            if self._span is not None:
                self._span()
            self._pool._a2a_waited()
        return out


class CommPool:
    """Priority pool of all-to-alls and chunked gradient all-reduces (see the module docstring).

    Constructing it is a collective of the whole world (every rank builds its pool with the
    same parameter list, at the same point): it takes its groups from the registry.

    Args:
        grad_sync: the gradient rules (``group_of(p)``: over which ranks; ``divisor``).
        params: the model's parameters (same structure and order on every rank).
        chunk_bytes: Sp, the all-reduce chunk size in bytes (settable between steps).
        recorder: where the all-to-all ("a2a") and chunk ("allreduce") spans go.
        timeout_s: deadline of every wait.
        reduce_in_backward: False: no hooks, every chunk is reduced at ``finish`` (moe-only).
        a2a_groups: EP groups whose row all-to-alls (``all_to_all``) run in the ``rows`` lane
            (the same number on every rank; default none: on the group itself).
    """

    def __init__(
        self,
        *,
        grad_sync: GradientSync,
        params: Sequence[nn.Parameter],
        chunk_bytes: int,
        recorder: Recorder,
        timeout_s: float,
        reduce_in_backward: bool = True,
        a2a_groups: Sequence[EPGroup] = (),
    ) -> None:
        self.chunk_bytes = chunk_bytes  # validated by the property
        check_positive("timeout_s", timeout_s)
        self.grad_sync, self.recorder, self.timeout_s = grad_sync, recorder, timeout_s
        self.reduce_in_backward = reduce_in_backward
        self.params = [p for p in params if p.requires_grad]
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        reduce_groups = [grad_sync.group_of(p) for p in self.params]
        ranks_N = [g.global_ranks if g.active else (self.rank,) for g in reduce_groups]
        self._layout = GradLayout(
            self.params, ranks_N, reduce_singletons=self.active and not shortcuts_allowed()
        )
        self._groups: dict[tuple[int, ...], EPGroup] = {}
        self._rows: dict[tuple[int, ...], EPGroup] = {}  # EP rank set -> its rows-lane group
        if self.active:
            self._check_sizes(len(a2a_groups))
            distinct = {g.global_ranks: g for g in reduce_groups}
            distinct.setdefault(tuple(range(dist.get_world_size())), EPGroup(None, timeout_s))
            keys = sorted(distinct)
            lanes = in_lanes([distinct[k] for k in keys], "grad")
            self._groups = dict(zip(keys, lanes))
            rows = {g.global_ranks: g for g in a2a_groups}
            self._rows = dict(zip(rows, in_lanes(list(rows.values()), "rows")))
        self._lock = threading.RLock()  # hooks may run on autograd's device threads
        self._device_spans = _DeviceSpans()
        self._a2a_unwaited = 0
        self._gap = False  # an all-to-all was waited and no other issued since: a gap is open
        self._a2a_closed = False  # the step's last all-to-all was issued (end_all_to_alls)
        self._armed = False
        self._finishing = False
        self._steps = 0
        self._next = 0  # the next chunk of the sequence to issue
        self._pending: list[Pending | None] = []  # each chunk's all-reduce, once issued
        self._hooks = []
        if reduce_in_backward:
            self._hooks = [
                p.register_post_accumulate_grad_hook(self._make_hook(i))
                for i, p in enumerate(self.params)
            ]

    # -- settings ---------------------------------------------------------------------------
    @property
    def chunk_bytes(self) -> int:
        """Sp: bytes per all-reduce chunk (takes effect at the next ``begin_step``)."""
        return self._chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self._chunk_bytes = check_positive_int("chunk_bytes", value)

    def _check_sizes(self, a2a_groups: int) -> None:
        """Every rank passes as many parameters and all-to-all groups (one all-gather)."""
        world = EPGroup(None, self.timeout_s)
        mine = world.control_tensor([[len(self.params), a2a_groups]])
        n_P2 = world.all_gather_dim0(mine, "all_gather of pool sizes")
        for k, what in enumerate(("params", "a2a_groups")):
            if len(set(n_P2[:, k].tolist())) != 1:
                raise ValueError(
                    f"{what}: every rank must pass the same number to CommPool, got "
                    f"{n_P2[:, k].tolist()} by rank"
                )

    @property
    def groups(self) -> dict[tuple[int, ...], EPGroup]:
        """The gradient groups by global reduction rank set (the ``grad`` lane)."""
        return dict(self._groups)

    # -- all-to-alls ------------------------------------------------------------------------
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        *,
        group: EPGroup,
        name: str,
        **args: Any,
    ) -> PendingA2A:
        """Issue ``all_to_all_single`` on ``group``'s rows lane now (this closes the open gap,
        if any); its span ("a2a", ``name``) ends when it completes."""
        args = {"bytes": input.numel() * input.element_size(), **args}
        rows = self._rows.get(group.global_ranks, group) if group.active else group
        if rows is not group and rows._parent is None:
            rows._parent = (group, list(range(group.size)))
        on_stream = group.size > 1 and rows.on_stream(input)
        with self._lock:
            self._gap = False
            self._a2a_unwaited += 1
            timed = on_stream and self.recorder.enabled
            start = self._device_spans.start(input.device) if timed else None
            t0 = self.recorder.now()
            pending = rows.start_all_to_all(
                output, input, output_splits, input_splits, f"all_to_all {name}"
            )
        span: Callable[[], None] | None = None
        if on_stream:
            if start is not None:

                def span() -> None:
                    self._device_spans.end("a2a", name, start, args, input.device)

        else:

            def done() -> None:
                self.recorder.add("a2a", name, t0, self.recorder.now(), **args)

            pending.add_done_callback(done)
        return PendingA2A(self, pending, span)

    def _a2a_waited(self) -> None:
        with self._lock:
            self._a2a_unwaited -= 1
            self._gap = True
            self._pump()

    def end_all_to_alls(self) -> None:
        """No more all-to-alls this step: once the schedule has waited for those issued, ready
        chunks no longer go one per gap (nothing is left for the priority rule to protect)."""
        with self._lock:
            self._a2a_closed = True
            self._pump()

    # -- gradients --------------------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(_p: torch.Tensor) -> None:
            with self._lock:
                if not self._armed:
                    return
                self._layout.record(i)
                if not self._finishing and self._layout.complete(i):
                    self._pump()

        return hook

    def begin_step(self) -> None:
        """Reset the hook counts and arm the hooks for this step's backward."""
        with self._lock:
            if self._chunk_bytes != self._layout.chunk_bytes:
                self._layout.build(self._chunk_bytes)
            self._layout.begin_step()
            self._next = 0
            self._pending = [None] * len(self._layout.chunks)
            self._finishing = False
            self._a2a_closed = False
            self._a2a_unwaited = 0
            self._gap = True  # the network is free until the step's first all-to-all
            device = self._stream_device() if self.recorder.enabled else None
            if device is not None:
                self._device_spans.begin(self.recorder.now(), device)
            self._armed = True

    def _stream_device(self) -> torch.device | None:
        """The device whose stream the gradients' collectives run on (None: the host's)."""
        return next(
            (
                b.staging.device
                for b in self._layout.buckets
                if b.staging is not None and self._groups[b.ranks].on_stream(b.staging)
            ),
            None,
        )

    # -- issuing ----------------------------------------------------------------------------
    def _ready(self) -> bool:
        chunks = self._layout.chunks
        return self._next < len(chunks) and chunks[self._next].missing == 0

    def _pump(self) -> None:
        """Issue what the rule allows at this point of the program order (lock held): in the
        tail every ready chunk, before it at most one per open gap."""
        if not self._armed or self._finishing:
            return
        if self._a2a_closed and self._a2a_unwaited == 0:
            self._layout.open_tail()
            while self._ready():
                self._issue(self._layout.chunks[self._next], phase="tail")
        elif self._gap and self._ready():
            self._gap = False
            self._issue(self._layout.chunks[self._next], phase="bwd")

    def _issue(self, chunk: Chunk, *, phase: str) -> None:
        """Stage the chunk's gradients and start its all-reduce. Called with the lock held."""
        data = self._layout.stage(chunk)
        self._next = chunk.index + 1
        chunk.issued = True
        ranks = self._layout.buckets[chunk.bucket].ranks
        group = self._groups[ranks]
        what = f"all_reduce chunk AR{chunk.index} ({chunk.nbytes} bytes) over ranks {list(ranks)}"
        args = {"bytes": chunk.nbytes, "phase": phase, "ranks": len(ranks)}
        if group.on_stream(data):
            start = self._device_spans.start(data.device) if self.recorder.enabled else None
            self._pending[chunk.index] = group.start_all_reduce(data, what=what)
            if start is not None:
                self._device_spans.end("allreduce", f"AR{chunk.index}", start, args, data.device)
            return
        t0 = self.recorder.now()
        pending = self._pending[chunk.index] = group.start_all_reduce(data, what=what)

        def done() -> None:
            self.recorder.add("allreduce", f"AR{chunk.index}", t0, self.recorder.now(), **args)

        pending.add_done_callback(done)

    def _agree(self) -> None:
        """After the first step's backward: every rank learns rank 0's ready order and which
        parameters had the same hook count on every rank (those complete early from now on)."""
        world = self._groups[tuple(range(dist.get_world_size()))]
        row_1X = world.control_tensor([self._layout.hook_row()])
        all_PX = world.all_gather_dim0(row_1X, "all_gather of gradient hook counts (CommPool)")
        self._layout.learn(all_PX)

    def finish(self, *, while_waiting: Callable[[], None] | None = None) -> None:
        """Issue every chunk not yet issued, wait each under the deadline (on a device: the
        current stream waits), and write the averaged gradients (``sum over group_of(p) /
        divisor``) back to ``p.grad``.

        Args:
            while_waiting: called once every chunk is issued, before waiting for them (work
                that needs no reduced gradient: it overlaps the step's last chunks).
        """
        with self._lock:
            if not self._armed:
                raise RuntimeError("CommPool.finish() called without begin_step()")
            self._finishing = True
        if self._steps == 0 and self.reduce_in_backward and self.active:
            # (no chunk was issued: no hook count was known yet)
            self._agree()
            with self._lock:
                self._layout.build(self._chunk_bytes)
                self._pending = [None] * len(self._layout.chunks)
        with self._lock:
            for chunk in self._layout.chunks[self._next :]:
                self._issue(chunk, phase="finish")
        if while_waiting is not None:
            while_waiting()
        for pending in self._pending:
            assert pending is not None  # internal: every chunk was issued above
            pending.wait()
        self._layout.write_back(self.grad_sync.divisor)
        if self.recorder.enabled:
            self._device_spans.resolve(self.recorder)
        with self._lock:
            self._armed = False
            self._steps += 1
            late, self._layout.late = self._layout.late, []
        if late:
            names = ", ".join(f"#{i} {tuple(self.params[i].shape)}" for i in sorted(set(late)))
            raise RuntimeError(
                f"CommPool: the gradient of parameter(s) {names} accumulated after its chunk "
                "was all-reduced (more backward passes reached it than in the first step); "
                "reduce such a schedule's gradients at finish (reduce_in_backward=False)"
            )

    def reduction_sets(self) -> list[tuple[tuple[int, ...], list[nn.Parameter]]]:
        """The pool's parameters by reduction rank set (a set of one rank: not reduced, only
        divided by the divisor at ``finish``)."""
        return self._layout.reduction_sets()

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
