"""Step-scoped one-sided puts with signals: the transfer the taskflow runtime runs on.

FlashDMoE (paper 003, §4-5) moves tiles with one-sided puts into a receive buffer and tells the
receiver with a per-tile signal; its Subscriber turns arrived signals into tasks, so a GEMM tile
starts as soon as *its* rows are there, not when a whole all-to-all ends. :class:`PutChannel` is
that transfer on torch.distributed point-to-point messages (gloo), sized for a layer that runs a
plan per step: one process group made once (when the layer is built, on every member, in the
same order), receive buffers that change with the shape bucket, and nothing left blocked in gloo
between steps (a receive that is still pending when the process exits aborts it). The signals
land in the step's :class:`~moesaic.comm.counters.EventCounters`.

* ``begin(buffer, counters, expected)`` starts a receiving thread for exactly ``expected`` puts
  of this step (both sides derive that number from the step's routing counts, so no stop message
  is needed); ``finish()`` waits for every send and for that thread, under the deadline.
* ``put(src, dst_rank, offset, events)`` writes flat ``src`` at element ``offset`` of
  ``dst_rank``'s buffer, then bumps each of ``events`` on ``dst_rank`` once the data is there
  (a header ``(source, offset, numel, n_events, events...)`` and the payload, in order on one
  pair; an empty ``src`` is a pure signal). Several events per put: one tile can release
  consumers whose producer sets differ (a task descriptor's ``trigger_events``).

Puts of one step must not reach a peer before it called ``begin`` of that step and after its
``finish`` of the step before: the caller fences steps (the taskflow runtime's per-step slot
count all-to-all does: no rank starts putting step n+1 before every rank finished step n).
A dead or silent peer becomes a :class:`CollectiveError` within the deadline, raised from
``finish`` and to every waiter of the step's counters; a channel that failed is broken (gloo
cannot re-post a timed-out receive) and refuses further steps.

Measured on loopback gloo (2 ranks on 2 shared CPU cores, torch 2.13, fp32 tiles of 16
elements, 64 B; ``python tests/comm/test_put_channel.py``, 6 worlds over two runs, 2026-11-25,
other work on the machine): 160-480 us per put pipelined (2000 puts in one step until the last
arrived; two gloo messages per put) and 185-1950 us one-way latency (half a 200-round
ping-pong), the spread being the machine's load. At these sizes the cost is gloo's per-message
overhead and the thread hand-off, not bytes: pack small tiles into fewer puts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moesaic.checks import check_positive
from moesaic.comm.collectives import CollectiveError, EPGroup, wait_work
from moesaic.comm.counters import EventCounters
from moesaic.trace import Recorder

__all__ = ["PutChannel", "PutTransport"]

_HEADER_TAG = 0x5201
_PAYLOAD_TAG = 0x5202
_FIXED = 4  # source, offset, numel, number of events
# Outstanding sends kept before the oldest half is waited on: bounds the memory pinned by tiles.
_MAX_PENDING = 512
# How long finish() waits for the Subscriber of a step that already failed.
_BROKEN_GRACE_S = 1.0


class PutTransport(Protocol):
    """The seam the taskflow runtime puts tiles through: :class:`PutChannel` (gloo, CPU) and
    ``comm.symmetric.SymmetricMemoryChannel`` (torch's symmetric memory, CUDA); the runtime
    picks one per step by ``comm.symmetric.pick_transport``.

    ``window`` allocates a receive window (once per bucket, on every rank in the same order);
    ``begin`` / ``put`` / ``finish`` / ``fail`` are one step, as documented on
    :class:`PutChannel`; ``puts_P``, ``bytes_P`` and ``header_bytes`` are the statistics."""

    puts_P: list[int]
    bytes_P: list[int]

    @property
    def header_bytes(self) -> int: ...

    def window(
        self, numel: int, dtype: torch.dtype, device: torch.device, num_events: int
    ) -> torch.Tensor: ...

    def begin(
        self,
        buffer: torch.Tensor,
        counters: EventCounters,
        expected: int,
        recorder: Recorder | None = None,
    ) -> None: ...

    def put(self, src: torch.Tensor, dst_rank: int, offset: int, events: Sequence[int]) -> None: ...

    def finish(self) -> None: ...

    def fail(self, message: str) -> None: ...


class PutChannel:
    """One-sided puts with multi-event signals over a dedicated clone of an EP group.

    Constructing it is a collective of the whole world (its group comes from the registry,
    ``comm.groups``, shared with every other layer's channel).

    Args:
        group: the expert-parallel group; ranks are its ranks. A group of one process needs no
            messages (every put is a self-put, done by the caller as a copy).
        timeout_s: deadline of every send, of every expected receive and of ``finish``.
        max_events: most events one put may signal (the header's length).
    """

    def __init__(self, group: EPGroup, timeout_s: float, max_events: int = 8) -> None:
        self.timeout_s = check_positive("timeout_s", timeout_s)
        self.rank, self.size = group.rank, group.size
        self.max_events = max_events
        self.group = group
        # the group's ranks in the registry's "puts" lane: one group shared by every layer
        puts = group.in_lane("puts") if group.size > 1 else None
        self.pg = puts.group if puts is not None else None
        # torch's point-to-point calls take global ranks, also on a subgroup (EP rank 1 of the
        # second EP group of EP 2 x DP 2 is global rank 3)
        self._global_P = puts.global_ranks if puts is not None else (0,)
        self._lock = threading.Lock()
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._thread: threading.Thread | None = None
        self._broken: str | None = None
        self._counters: EventCounters | None = None
        self.puts = 0  # puts issued (messages with a payload or a signal), all steps
        self.puts_P = [0] * self.size  # puts to each rank, all steps
        self.bytes_P = [0] * self.size  # payload bytes sent to each rank, all steps

    @property
    def header_bytes(self) -> int:
        """Bytes of one put's header message."""
        return (_FIXED + self.max_events) * 8

    def window(
        self, numel: int, dtype: torch.dtype, device: torch.device, num_events: int
    ) -> torch.Tensor:
        """A zeroed flat receive window (gloo needs no registration: any CPU tensor will do)."""
        return torch.zeros(numel, dtype=dtype, device=device)

    # -- one step -----------------------------------------------------------------------------
    def begin(
        self,
        buffer: torch.Tensor,
        counters: EventCounters,
        expected: int,
        recorder: Recorder | None = None,
    ) -> None:
        """Start receiving this step's ``expected`` puts into flat ``buffer``."""
        if self._broken:
            raise CollectiveError(f"the put channel is broken by an earlier error: {self._broken}")
        if self._thread is not None:
            raise ValueError("begin called twice without finish")
        self._counters = counters
        if expected == 0 or self.pg is None:
            return
        self._thread = threading.Thread(
            target=self._receive,
            args=(buffer, counters, expected, recorder),
            name=f"moesaic-subscriber-{self.rank}",
            daemon=True,
        )
        self._thread.start()

    def put(self, src: torch.Tensor, dst_rank: int, offset: int, events: Sequence[int]) -> None:
        """Send flat contiguous ``src`` to ``offset`` of ``dst_rank``'s buffer, then signal."""
        if self.pg is None or dst_rank == self.rank:
            raise ValueError(f"dst_rank ({dst_rank}) must be another rank: self-puts are copies")
        if len(events) > self.max_events:
            raise ValueError(f"a put signals at most max_events ({self.max_events}) events")
        head = [self.rank, offset, src.numel(), len(events), *events]
        head += [0] * (self.max_events - len(events))
        header = torch.tensor(head, dtype=torch.int64)
        with self._lock:
            self._send(header, dst_rank, _HEADER_TAG)
            if src.numel():
                self._send(src, dst_rank, _PAYLOAD_TAG)
            nbytes = src.numel() * src.element_size()
            self.puts += 1
            self.puts_P[dst_rank] += 1
            self.bytes_P[dst_rank] += nbytes
            # counted in the EP group's traffic like its collectives (headers included)
            self.group.count_sent(dst_rank, nbytes + self.header_bytes)

    def finish(self) -> None:
        """Wait for every send of this step and for its receiving thread (under the deadline)."""
        try:
            with self._lock:
                pending, self._pending = self._pending, []
            self._wait_sends(pending)
            if self._thread is not None:
                # A broken step (this rank failed or was interrupted) does not wait the full
                # deadline for puts its interrupted peers will never send: its Subscriber, a
                # daemon blocked in irecv, is left behind with the broken channel (a group
                # that saw an error is not reused). Ctrl-C took ~31 s in 6 of 24 tries.
                self._thread.join(_BROKEN_GRACE_S if self._broken else self.timeout_s)
                if self._thread.is_alive() and not self._broken:
                    self._fail(f"rank {self.rank} still waits for puts after {self.timeout_s:g}s")
                    raise CollectiveError(
                        f"taskflow puts to rank {self.rank} did not all arrive within "
                        f"{self.timeout_s:g}s: a peer died, hung or runs another plan"
                    )
            if self._broken:
                raise CollectiveError(f"taskflow puts failed on rank {self.rank}: {self._broken}")
        finally:
            self._thread = None
            self._counters = None

    def fail(self, message: str) -> None:
        """Mark the channel broken and wake every waiter of the step (a worker failed)."""
        self._fail(message)

    # -- internals ----------------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self._broken = self._broken or message
        if self._counters is not None:
            self._counters.fail(message)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        try:
            work = dist.isend(tensor, self._global_P[dst], group=self.pg, tag=tag)
        except RuntimeError as exc:  # gloo sees a closed connection at once
            self._fail(f"send to rank {dst} failed")
            raise CollectiveError(
                f"taskflow put from rank {self.rank} to rank {dst} failed: the peer died. "
                f"Cause: {str(exc).splitlines()[0][:300]}"
            ) from exc
        self._pending.append((work, tensor))
        if len(self._pending) > _MAX_PENDING:
            half = len(self._pending) // 2
            self._wait_sends(self._pending[:half])
            del self._pending[:half]

    def _wait_sends(self, pending: list[tuple[Any, torch.Tensor]]) -> None:
        for work, _ in pending:
            wait_work(work, f"taskflow put failed on rank {self.rank}", self.timeout_s)

    def _receive(
        self,
        buffer: torch.Tensor,
        counters: EventCounters,
        expected: int,
        recorder: Recorder | None,
    ) -> None:
        """The Subscriber: ``expected`` headers from any peer, payloads into ``buffer``,
        then the signals (FlashDMoE Alg. 2's decode step: the counters' listeners turn them
        into ready tasks)."""
        header = torch.zeros(_FIXED + self.max_events, dtype=torch.int64)
        try:
            for _ in range(expected):
                work = dist.irecv(header, None, group=self.pg, tag=_HEADER_TAG)
                wait_work(work, f"a put header did not reach rank {self.rank}", self.timeout_s)
                start = time.perf_counter()
                source, offset, numel, n, *events = header.tolist()
                if numel:
                    view = buffer[offset : offset + numel]
                    src = self._global_P[source]
                    work = dist.irecv(view, src, group=self.pg, tag=_PAYLOAD_TAG)
                    wait_work(
                        work,
                        f"a put payload from rank {source} did not reach rank {self.rank}",
                        self.timeout_s,
                    )
                for ev in events[:n]:
                    counters.bump(ev)
                if recorder is not None:
                    recorder.add("subscriber", f"put<-{source}", start, time.perf_counter())
        except Exception as exc:  # deadlines, gloo errors, a listener that raised: all fatal
            self._fail(f"the receiving thread stopped: {(str(exc).splitlines() or [''])[0][:300]}")
