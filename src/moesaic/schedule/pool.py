"""The communication pool of FlowMoE (paper Alg. 2): all-to-alls first, gradient all-reduce in
Sp-byte chunks in the gaps.

Shape legend: N parameters, P ranks.

Two kinds of collective share the network of a rank:

* all-to-alls (the pipeline's D and C stages) are issued at once, on their EP group, when the
  schedule asks (``all_to_all``); the pool only counts them while they are queued or in flight;
* gradient all-reduces run on process groups of their own (one ``dist.new_group`` per distinct
  reduction rank set, created in the same order on every rank), so that a rank whose all-reduce
  chunks go out earlier or later than a peer's never mismatches a collective of the EP group.

A gradient enters the pool from a per-parameter post-accumulate hook once its backward over all
R chunks is complete (its hook count reaches the count learned in the first step, which reduces
everything at ``finish``). Parameters are laid out, in the ready order rank 0 saw in the first
step, in one flat staging buffer per (reduction rank set, dtype); the buffers are cut into
chunks of ``chunk_bytes`` (Sp), and the chunks form one sequence that every rank issues in the
same order (so ranks sharing groups never wait on each other in a cycle). A background thread
issues the next chunk when every parameter it covers is complete, no all-to-all is queued or in
flight on this rank, and no other chunk is in flight: at most one chunk is in flight during the
backward. Once the schedule says its last all-to-all of the step has been issued
(``end_all_to_alls``) and it has completed, there is nothing left to protect: every ready chunk
goes at once, several in flight (the step's tail). ``finish`` issues the rest at once, waits each
under the deadline, and writes ``sum / divisor`` back to ``p.grad``. A parameter whose gradient never arrived on this rank reduces zeros, so every rank
issues the same chunks. Reduction rank sets of one rank (expert shards without replicas) are not
reduced, only divided.
"""

from __future__ import annotations

import datetime
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moesaic.checks import check_positive, check_positive_int
from moesaic.comm.collectives import EPGroup, wait_work

if TYPE_CHECKING:
    from moesaic.schedule.base import GradientSync
    from moesaic.trace import Recorder

__all__ = ["CommPool", "PendingA2A"]


class PendingA2A:
    """An all-to-all issued by the pool; ``wait()`` returns its output once it has arrived."""

    def __init__(self, work: Any, output: torch.Tensor, what: str, rank: int, timeout_s: float):
        self._work, self._output, self._what = work, output, what
        self._rank, self._timeout_s = rank, timeout_s

    def wait(self) -> torch.Tensor:
        """The received rows (a ``CollectiveError`` naming the op if the deadline passes)."""
        if self._work is not None:
            wait_work(self._work, f"{self._what} failed on rank {self._rank}", self._timeout_s)
            self._work = None
        return self._output


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
    work: Any = None
    done: bool = False  # set by the completion callback
    start: float = 0.0
    nbytes: int = field(default=0)


class CommPool:
    """Priority pool of all-to-alls and chunked gradient all-reduces (see the module docstring).

    Constructing it is a collective (every rank builds its pool with the same parameter list, at
    the same point): it creates the all-reduce process groups.

    Args:
        grad_sync: the gradient rules (``group_of(p)``: over which ranks; ``divisor``).
        params: the model's parameters (same structure and order on every rank).
        chunk_bytes: Sp, the all-reduce chunk size in bytes (settable between steps).
        recorder: where the all-to-all ("a2a") and chunk ("allreduce") spans go.
        timeout_s: deadline of every wait.
        reduce_in_backward: False: no hooks, every chunk is reduced at ``finish`` (moe-only).
        a2a_groups: EP groups whose data all-to-alls (``all_to_all``) run on a process group of
            their own, a clone with the same ranks (same number on every rank; default none:
            on the group itself). A strategy's small synchronous exchanges on the EP group
            (the dispatch counts) then never queue behind a chunk's rows in flight.
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
        self._ranks_N = [self._group_ranks(grad_sync.group_of(p)) for p in self.params]
        self._a2a_ranks = [self._group_ranks(g) for g in a2a_groups]
        self._a2a_pgs: dict[tuple[int, ...], Any] = {}  # EP rank set -> its clone for rows
        self._groups = self._make_groups() if self.active else {}
        self._cond = threading.Condition(threading.RLock())
        self._a2a_pending = 0
        self._a2a_closed = False  # the step's last all-to-all was issued (end_all_to_alls)
        self._stop = False
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
        self._thread = threading.Thread(target=self._loop, name="moesaic-comm-pool", daemon=True)
        self._thread.start()

    # -- settings ---------------------------------------------------------------------------
    @property
    def chunk_bytes(self) -> int:
        """Sp: bytes per all-reduce chunk (takes effect at the next ``begin_step``)."""
        return self._chunk_bytes

    @chunk_bytes.setter
    def chunk_bytes(self, value: int) -> None:
        self._chunk_bytes = check_positive_int("chunk_bytes", value)

    # -- groups -----------------------------------------------------------------------------
    def _group_ranks(self, group: EPGroup) -> tuple[int, ...]:
        if not group.active:
            return (0,)
        if group.group is None:
            return tuple(range(dist.get_world_size()))
        return tuple(dist.get_process_group_ranks(group.group))

    def _make_groups(self) -> dict[tuple[int, ...], Any]:
        """One new process group per distinct reduction rank set of any rank (every rank
        creates every group, in the same sorted order), plus one of all ranks."""
        W = dist.get_world_size()
        world = EPGroup(None, self.timeout_s)
        sizes_1 = torch.tensor([[len(self.params), len(self._a2a_ranks)]])
        n_P2 = world.all_gather_dim0(sizes_1, "all_gather of pool sizes")
        for k, what in enumerate(("params", "a2a_groups")):
            if len(set(n_P2[:, k].tolist())) != 1:
                raise ValueError(
                    f"{what}: every rank must pass the same number to CommPool, got "
                    f"{n_P2[:, k].tolist()} by rank"
                )
        # each parameter's rank set as a bit mask in int64 words of 62 bits (any world size)
        words = -(-W // 62)
        N = len(self.params)
        mask_1NW = torch.tensor(
            [[[sum(1 << (r - 62 * w) for r in ranks if r // 62 == w) for w in range(words)]
              for ranks in [*self._ranks_N, *self._a2a_ranks]]]
        )  # fmt: skip
        masks_PNW = world.all_gather_dim0(mask_1NW, "all_gather of pool reduction groups")

        def rank_sets(masks_XW: torch.Tensor) -> set[tuple[int, ...]]:
            return {
                tuple(r for r in range(W) if m_W[r // 62] >> (r % 62) & 1)
                for m_W in masks_XW.reshape(-1, words).tolist()
            }

        sets = rank_sets(masks_PNW[:, :N]) | {tuple(range(W))}
        timeout = datetime.timedelta(seconds=self.timeout_s)
        groups: dict[tuple[int, ...], Any] = {}
        for ranks in sorted(s for s in sets if len(s) > 1):
            pg = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                groups[ranks] = pg
        for ranks in sorted(s for s in rank_sets(masks_PNW[:, N:]) if len(s) > 1):
            pg = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                self._a2a_pgs[ranks] = pg
        return groups

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
        """Issue ``all_to_all_single`` on ``group`` now; its span ("a2a", ``name``) ends when it
        completes. No all-reduce chunk starts on this rank while it is queued or in flight."""
        nbytes = input.numel() * input.element_size()
        what = f"all_to_all {name}"
        if group.size == 1:
            t = self.recorder.now()
            output.copy_(input)
            self.recorder.add("a2a", name, t, self.recorder.now(), bytes=nbytes, **args)
            return PendingA2A(None, output, what, group.rank, self.timeout_s)
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        rows_P = input_splits or [input.shape[0] // group.size] * group.size
        group._count([rows * row_bytes for rows in rows_P])
        pg = self._a2a_pgs.get(self._group_ranks(group), group.group) if self._a2a_pgs else None
        with self._cond:
            self._a2a_pending += 1
            start = self.recorder.now()
            work = dist.all_to_all_single(
                output, input, output_splits, input_splits, group=pg or group.group,
                async_op=True,
            )  # fmt: skip

        def done(_fut: Any) -> None:
            end = self.recorder.now()
            with self._cond:
                self._a2a_pending -= 1
                self._cond.notify_all()
            self.recorder.add("a2a", name, start, end, bytes=nbytes, **args)

        work.get_future().add_done_callback(done)
        return PendingA2A(work, output, what, group.rank, self.timeout_s)

    def end_all_to_alls(self) -> None:
        """No more all-to-alls this step: once those issued have completed, ready chunks no
        longer go one at a time (nothing is left for the priority rule to protect)."""
        with self._cond:
            self._a2a_closed = True
            self._cond.notify_all()

    # -- gradients --------------------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(_p: torch.Tensor) -> None:
            with self._cond:
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
                    self._complete(i)
                    self._cond.notify_all()

        return hook

    def _complete(self, i: int) -> None:
        for c in self._chunks_of_N[i]:
            self._chunks[c].missing -= 1

    def begin_step(self) -> None:
        """Reset the hook counts and arm the hooks for this step's backward."""
        with self._cond:
            if self._chunk_bytes != self._layout_bytes:
                self._build_layout()
            self._counts_N = [0] * len(self.params)
            self._last_N = [-1] * len(self.params)
            self._seq, self._next, self._late = 0, 0, []
            for c in self._chunks:
                c.missing = len({s[0] for s in c.segments})
                c.issued, c.done, c.work = False, False, None
            self._finishing = False
            self._a2a_closed = False
            self._armed = True

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
            b = _Bucket(ranks=ranks, dtype=dtype, params=members, offsets=offsets[:-1],
                        numel=offsets[-1])  # fmt: skip
            self._buckets.append(b)
            if len(ranks) == 1:
                continue  # no replicas: divided at finish, never reduced
            staging = old.get((ranks, dtype))
            b.staging = staging if staging is not None and staging.numel() == b.numel else (
                torch.empty(b.numel, dtype=dtype, device=self.params[members[0]].device)
            )  # fmt: skip
            esize = torch.tensor([], dtype=dtype).element_size()
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
    def _can_issue(self) -> bool:
        return (
            self._armed
            and not self._finishing
            and self._next < len(self._chunks)
            and self._chunks[self._next].missing == 0
            and self._a2a_pending == 0
            and (self._a2a_closed or self._next == 0 or self._chunks[self._next - 1].done)
        )

    def _loop(self) -> None:
        with self._cond:
            while True:
                while not (self._stop or self._can_issue()):
                    self._cond.wait()
                if self._stop:
                    return
                self._issue(self._chunks[self._next], phase="tail" if self._a2a_closed else "bwd")

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
        chunk.start = self.recorder.now()
        chunk.work = dist.all_reduce(
            bucket.staging[chunk.lo : chunk.hi], group=self._groups[bucket.ranks], async_op=True
        )
        args = {"bytes": chunk.nbytes, "phase": phase, "ranks": len(bucket.ranks)}

        def done(_fut: Any, chunk: _Chunk = chunk) -> None:
            end = self.recorder.now()
            with self._cond:
                chunk.done = True
                self._cond.notify_all()
            self.recorder.add("allreduce", f"AR{chunk.index}", chunk.start, end, **args)

        chunk.work.get_future().add_done_callback(done)

    def _agree(self) -> None:
        """After the first step's backward: every rank learns rank 0's ready order and which
        parameters had the same hook count on every rank (those complete early from now on)."""
        world = EPGroup(self._groups[tuple(range(dist.get_world_size()))], self.timeout_s)
        row_1X = torch.tensor([self._counts_N + self._last_N], dtype=torch.int64)
        all_PX = world.all_gather_dim0(row_1X, "all_gather of gradient hook counts (CommPool)")
        N = len(self.params)
        counts_PN, last_N = all_PX[:, :N], all_PX[0, N:].tolist()
        same_N = (counts_PN == counts_PN[:1]).all(dim=0).tolist()
        self._expected_N = [
            int(counts_PN[0, i]) if same_N[i] else 0 for i in range(N)
        ]  # fmt: skip
        seen = sorted((last, i) for i, last in enumerate(last_N) if last >= 0)
        rest = [i for i in reversed(range(N)) if last_N[i] < 0]
        self._order = [i for _, i in seen] + rest

    def finish(self, *, while_waiting: Callable[[], None] | None = None) -> None:
        """Issue every chunk not yet issued (all at once: no all-to-all is left), wait each
        under the deadline, and write the averaged gradients (``sum over group_of(p) /
        divisor``) back to ``p.grad``.

        Args:
            while_waiting: called once every chunk is issued, before waiting for them (work
                that needs no reduced gradient: it overlaps the step's last chunks).
        """
        with self._cond:
            if not self._armed:
                raise RuntimeError("CommPool.finish() called without begin_step()")
            self._finishing = True
        if self._steps == 0 and self.reduce_in_backward and self.active:
            # (no chunk was issued: no hook count was known yet)
            self._agree()
            with self._cond:
                self._build_layout()
        with self._cond:
            for chunk in self._chunks[self._next :]:
                self._issue(chunk, phase="finish")
        if while_waiting is not None:
            while_waiting()
        for chunk in self._chunks:
            self._wait_chunk(chunk)
        self._write_back()
        with self._cond:
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

    def _wait_chunk(self, chunk: _Chunk) -> None:
        ranks = self._buckets[chunk.bucket].ranks
        what = f"all_reduce chunk AR{chunk.index} ({chunk.nbytes} bytes) over ranks {list(ranks)}"
        wait_work(chunk.work, f"{what} failed on rank {self.rank}", self.timeout_s)

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
        """Remove the hooks and stop the pool thread."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
