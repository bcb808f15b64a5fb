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
everything at ``finish``). Parameters are laid out, in the ready order rank 0 saw in the first
step, in one flat staging buffer per (reduction rank set, dtype); the buffers are cut into
chunks of ``chunk_bytes`` (Sp), and the chunks form one sequence that every rank issues in the
same order.

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
step's tail). ``finish`` issues the rest, waits each under the deadline, and writes
``sum / divisor`` back to ``p.grad``. A parameter whose gradient never arrived on this rank
reduces zeros, so every rank issues the same chunks. Reduction rank sets of one rank (expert
shards without replicas) are not reduced, only divided.

Trace spans: on gloo a transfer's span ends when its work completes (the work's future); on a
device stream the future completes at enqueue, so spans are timed by CUDA events recorded around
the transfer and resolved at ``finish`` (one host synchronisation per step, only when the
recorder is enabled).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moesaic.checks import check_positive, check_positive_int
from moesaic.comm.collectives import EPGroup, Pending, in_lanes

if TYPE_CHECKING:
    from moesaic.schedule.base import GradientSync
    from moesaic.trace import Recorder

__all__ = ["CommPool", "PendingA2A"]


class _DeviceSpans:
    """Spans of transfers on a device stream, timed by CUDA events: each transfer records a
    start event before it is issued and an end event once the stream waited for it; at
    ``resolve`` the events are turned into host times through one anchor (event, host time)
    taken at the start of the step."""

    def __init__(self) -> None:
        self._anchor: tuple[Any, float] | None = None
        self._open: list[tuple[str, str, Any, Any, dict[str, Any]]] = []

    def begin(self, now: float) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._anchor, self._open = (ev, now), []

    def start(self) -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def end(self, resource: str, name: str, start: Any, args: dict[str, Any]) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self._open.append((resource, name, start, ev, args))

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


@dataclass(kw_only=True, slots=True)
class _Bucket:
    """Parameters of one reduction rank set and dtype, laid out in one flat buffer."""

    ranks: tuple[int, ...]
    dtype: torch.dtype
    params: list[int]  # indices into CommPool.params, in layout order
    offsets: list[int]  # element offset of each param in the buffer
    numel: int
    staging: torch.Tensor | None = None


@dataclass(kw_only=True, slots=True)
class _Chunk:
    """Elements [lo, hi) of one bucket; ready when every covered parameter is complete."""

    index: int
    bucket: int
    lo: int
    hi: int
    segments: list[tuple[int, int, int, int]]  # (param index, param lo, param hi, buffer lo)
    missing: int = 0  # covered params not yet complete this step
    issued: bool = False
    pending: Pending | None = None
    start: float = 0.0
    nbytes: int = field(default=0)


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
        self._ranks_N = [g.global_ranks if g.active else (0,) for g in reduce_groups]
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
        self._counts_N = [0] * len(self.params)
        self._last_N = [-1] * len(self.params)  # hook sequence number of the latest call
        self._seq = 0
        self._expected_N: list[int] = [0] * len(self.params)  # 0: reduce at finish only
        self._late: list[int] = []
        self._order: list[int] = list(reversed(range(len(self.params))))
        self._buckets: list[_Bucket] = []
        self._chunks: list[_Chunk] = []
        self._chunks_of_N: list[list[int]] = [[] for _ in self.params]
        self._next = 0
        self._layout_bytes = -1
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
            start = self._device_spans.start() if on_stream and self.recorder.enabled else None
            t0 = self.recorder.now()
            pending = rows.start_all_to_all(
                output, input, output_splits, input_splits, f"all_to_all {name}"
            )
        span: Callable[[], None] | None = None
        if on_stream:
            if start is not None:

                def span() -> None:
                    self._device_spans.end("a2a", name, start, args)

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
                self._counts_N[i] += 1
                self._last_N[i] = self._seq
                self._seq += 1
                expected = self._expected_N[i]
                if expected == 0 or self._finishing:
                    return
                if self._counts_N[i] > expected:
                    if any(self._chunks[c].issued for c in self._chunks_of_N[i]):
                        self._late.append(i)
                elif self._counts_N[i] == expected:
                    for c in self._chunks_of_N[i]:
                        self._chunks[c].missing -= 1
                    self._pump()

        return hook

    def begin_step(self) -> None:
        """Reset the hook counts and arm the hooks for this step's backward."""
        with self._lock:
            if self._chunk_bytes != self._layout_bytes:
                self._build_layout()
            self._counts_N = [0] * len(self.params)
            self._last_N = [-1] * len(self.params)
            self._seq, self._next, self._late = 0, 0, []
            for c in self._chunks:
                c.missing = len({s[0] for s in c.segments})
                c.issued, c.pending = False, None
            self._finishing = False
            self._a2a_closed = False
            self._a2a_unwaited = 0
            self._gap = True  # the network is free until the step's first all-to-all
            if self.recorder.enabled and self._on_device():
                self._device_spans.begin(self.recorder.now())
            self._armed = True

    def _on_device(self) -> bool:
        """Whether the gradients' collectives run on a device stream."""
        return any(
            self._groups[b.ranks].on_stream(b.staging)
            for b in self._buckets
            if b.staging is not None
        )

    def _build_layout(self) -> None:
        """Buckets in the agreed order, cut into ``chunk_bytes`` chunks, one global sequence."""
        keyed: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
        for i in self._order:
            keyed.setdefault((self._ranks_N[i], self.params[i].dtype), []).append(i)
        position = {i: k for k, i in enumerate(self._order)}
        old = {(b.ranks, b.dtype): b.staging for b in self._buckets}
        self._buckets, chunks = [], []
        self._chunks_of_N = [[] for _ in self.params]
        for (ranks, dtype), members in keyed.items():
            offsets = [0]
            for i in members:
                offsets.append(offsets[-1] + self.params[i].numel())
            b = _Bucket(
                ranks=ranks, dtype=dtype, params=members, offsets=offsets[:-1], numel=offsets[-1]
            )
            self._buckets.append(b)
            if len(ranks) == 1:
                continue  # no replicas: divided at finish, never reduced
            staging = old.get((ranks, dtype))
            if staging is None or staging.numel() != b.numel:
                staging = torch.empty(b.numel, dtype=dtype, device=self.params[members[0]].device)
            b.staging = staging
            esize = staging.element_size()
            step = max(1, self._chunk_bytes // esize)
            for lo in range(0, b.numel, step):
                hi = min(lo + step, b.numel)
                segs = []
                for i, off in zip(members, b.offsets):
                    n = self.params[i].numel()
                    a, z = max(lo, off), min(hi, off + n)
                    if a < z:
                        segs.append((i, a - off, z - off, a))
                last = max(position[s[0]] for s in segs)
                chunks.append((last, len(self._buckets) - 1, lo, hi, segs, esize))
        chunks.sort(key=lambda c: (c[0], c[1], c[2]))
        self._chunks = []
        for k, (_, bi, lo, hi, segs, esize) in enumerate(chunks):
            self._chunks.append(
                _Chunk(index=k, bucket=bi, lo=lo, hi=hi, segments=segs, nbytes=(hi - lo) * esize)
            )
            for i in {s[0] for s in segs}:
                self._chunks_of_N[i].append(k)
        self._layout_bytes = self._chunk_bytes

    # -- issuing ----------------------------------------------------------------------------
    def _ready(self) -> bool:
        return self._next < len(self._chunks) and self._chunks[self._next].missing == 0

    def _pump(self) -> None:
        """Issue what the rule allows at this point of the program order (lock held): in the
        tail every ready chunk, before it at most one per open gap."""
        if not self._armed or self._finishing:
            return
        if self._a2a_closed and self._a2a_unwaited == 0:
            while self._ready():
                self._issue(self._chunks[self._next], phase="tail")
        elif self._gap and self._ready():
            self._gap = False
            self._issue(self._chunks[self._next], phase="bwd")

    def _issue(self, chunk: _Chunk, *, phase: str) -> None:
        """Copy the chunk's gradients (zeros where none) into its buffer slice and start its
        all-reduce. Called with the lock held."""
        bucket = self._buckets[chunk.bucket]
        assert bucket.staging is not None  # internal: size-1 buckets have no chunks
        for i, plo, phi, blo in chunk.segments:
            dst = bucket.staging[blo : blo + phi - plo]
            grad = self.params[i].grad
            if grad is None:
                dst.zero_()
            else:
                dst.copy_(grad.reshape(-1)[plo:phi])
        self._next = chunk.index + 1
        chunk.issued = True
        group = self._groups[bucket.ranks]
        what = f"all_reduce chunk AR{chunk.index} ({chunk.nbytes} bytes) over ranks {list(bucket.ranks)}"
        data = bucket.staging[chunk.lo : chunk.hi]
        args = {"bytes": chunk.nbytes, "phase": phase, "ranks": len(bucket.ranks)}
        if group.on_stream(data):
            start = self._device_spans.start() if self.recorder.enabled else None
            chunk.pending = group.start_all_reduce(data, what=what)
            if start is not None:
                self._device_spans.end("allreduce", f"AR{chunk.index}", start, args)
            return
        chunk.start = self.recorder.now()
        chunk.pending = group.start_all_reduce(data, what=what)

        def done(chunk: _Chunk = chunk) -> None:
            self.recorder.add(
                "allreduce", f"AR{chunk.index}", chunk.start, self.recorder.now(), **args
            )

        chunk.pending.add_done_callback(done)

    def _agree(self) -> None:
        """After the first step's backward: every rank learns rank 0's ready order and which
        parameters had the same hook count on every rank (those complete early from now on)."""
        world = self._groups[tuple(range(dist.get_world_size()))]
        row_1X = world.control_tensor([self._counts_N + self._last_N])
        all_PX = world.all_gather_dim0(row_1X, "all_gather of gradient hook counts (CommPool)")
        N = len(self.params)
        counts_PN, last_N = all_PX[:, :N].cpu(), all_PX[0, N:].tolist()
        same_N = (counts_PN == counts_PN[:1]).all(dim=0).tolist()
        self._expected_N = [int(counts_PN[0, i]) if same_N[i] else 0 for i in range(N)]
        seen = sorted((last, i) for i, last in enumerate(last_N) if last >= 0)
        rest = [i for i in reversed(range(N)) if last_N[i] < 0]
        self._order = [i for _, i in seen] + rest

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
                self._build_layout()
        with self._lock:
            for chunk in self._chunks[self._next :]:
                self._issue(chunk, phase="finish")
        if while_waiting is not None:
            while_waiting()
        for chunk in self._chunks:
            assert chunk.pending is not None  # internal: every chunk was issued above
            chunk.pending.wait()
        self._write_back()
        if self.recorder.enabled:
            self._device_spans.resolve(self.recorder)
        with self._lock:
            self._armed = False
            self._steps += 1
            late, self._late = self._late, []
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
        by_ranks: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for i, p in enumerate(self.params):
            by_ranks.setdefault(self._ranks_N[i], []).append(p)
        return list(by_ranks.items())

    def _write_back(self) -> None:
        divisor = self.grad_sync.divisor
        for b in self._buckets:
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                if b.staging is None:  # no replicas: divide only
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.div_(divisor)
                    continue
                avg = b.staging[off : off + p.numel()].view_as(p).div_(divisor)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)

    def close(self) -> None:
        """Remove the gradient hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
