"""One-sided tile transfers with a signal: ``put_with_signal`` into a symmetric receive buffer.

FlashDMoE (paper 003, §4-5) moves tiles with one-sided puts into a symmetric heap and tells the
receiver with a per-tile signal; its Subscriber turns arrived signals into tasks, so a GEMM tile
starts as soon as *its* rows are there, not when a whole all-to-all ends. HyperParallel-MoE
(paper 000, §4.4-4.5) synchronises tile tasks with event counters and thresholds. This module is
that transfer on torch.distributed:

* :class:`SymmetricBuffer`: one flat receive tensor per rank, allocated once, the same size and
  dtype on every rank (checked when the window opens); regions are ``(offset, numel)`` in
  elements, so a layout (``moesaic.taskflow.layout``) can hand out the offsets.
* :class:`EventCounters`: per-event monotonically increasing counters; ``wait(event, threshold,
  timeout_s)`` returns once the count reaches the threshold, or raises :class:`CollectiveError`
  naming the event, the threshold and the count reached.
* :class:`OneSidedWindow`: the buffer, the counters and a :class:`Transport`.
  ``put_with_signal(src, dst_rank, dst_region, dst_event)`` writes ``src`` into ``dst_rank``'s
  buffer at ``dst_region`` and bumps ``dst_rank``'s counter ``dst_event`` only after the data is
  completely written there. Self-puts are local copies.

Transports. :class:`GlooTransport` (CPU): per put a header message ``(kind, source, offset,
numel, event)`` and the payload, ``dist.isend`` on a process group of its own; on the receiver
one thread (the Subscriber) takes headers from any source, receives the payload straight into
the buffer view, then bumps the counter under a ``threading.Condition``. Messages of one pair
arrive in order, so a signal never overtakes its data. :class:`SymmetricMemoryTransport` is the
seam for CUDA symmetric memory / NVSHMEM puts (``torch.distributed._symmetric_memory``); it is
not implemented and says so.

Deadlines. Every wait is bounded: a consumer's ``wait`` by its ``timeout_s``, sends by the
window's ``timeout_s``. gloo does not report a dead peer to a pending receive-from-any (it waits
for the group timeout) and a timed-out gloo receive cannot be re-posted, so the Subscriber blocks
without polling and the *consumer's* deadline turns a peer that died before or during a transfer
into a ``CollectiveError``; an error the Subscriber does see (a payload that never completes) is
raised to every waiter at once.

Shutdown (``close``, or leaving the ``with`` block) is collective: every rank flushes its sends
and sends a stop message to each peer; a rank's Subscriber ends after the stop of every peer,
which arrives after all of that peer's puts.

Measured on loopback gloo (2 ranks on 2 shared CPU cores, torch 2.13, fp32 tiles of 16 elements,
64 B; ``python tests/comm/test_onesided.py``, 6 worlds over two runs, 2026-11-22): 117-200 us per
put pipelined (2000 puts, then one wait; two gloo messages per put) and 198-300 us one-way
latency (put until the peer's wait returns, half a 200-round ping-pong). At these sizes the cost
is gloo's per-message overhead and the thread hand-off, not bytes: pack small tiles into fewer
puts.
"""

from __future__ import annotations

import datetime
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from moesaic.checks import check_int, check_positive, check_positive_int, is_int
from moesaic.comm.collectives import CollectiveError, Traffic, wait_work

__all__ = [
    "EventCounters",
    "GlooTransport",
    "OneSidedWindow",
    "SoloTransport",
    "SymmetricBuffer",
    "SymmetricMemoryTransport",
    "Transport",
]

_HEADER_TAG = 0x5101
_PAYLOAD_TAG = 0x5102
_PUT, _STOP = 1, 2
_HEADER_LEN = 5  # kind, source rank, offset, numel, event
# Outstanding sends kept before the oldest is waited on: bounds the memory pinned by src tiles.
_MAX_PENDING = 256


class SymmetricBuffer:
    """A flat receive tensor, allocated once; the same numel and dtype on every rank.

    Args:
        numel: elements in the buffer (> 0).
        dtype: element type of every tile put into it.
    """

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32) -> None:
        self.numel = check_positive_int("numel", numel)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.data = torch.zeros(numel, dtype=dtype)

    def check_region(self, name: str, region: Sequence[int]) -> tuple[int, int]:
        """``region = (offset, numel)`` lies inside the buffer; returns it as ints."""
        if len(region) != 2 or not all(is_int(v) for v in region):
            raise ValueError(f"{name} must be (offset, numel) ints, got {region!r}")
        offset, numel = int(region[0]), int(region[1])
        check_int(f"{name} offset", offset, minimum=0)
        check_positive_int(f"{name} numel", numel)
        if offset + numel > self.numel:
            raise ValueError(
                f"{name} ({offset}, {numel}) must lie inside the buffer: "
                f"offset + numel = {offset + numel} > buffer numel {self.numel}"
            )
        return offset, numel

    def region(self, offset: int, numel: int) -> torch.Tensor:
        """The view of ``numel`` elements at ``offset`` (validated)."""
        offset, numel = self.check_region("region", (offset, numel))
        return self.data[offset : offset + numel]


class EventCounters:
    """Per-event counters that only go up, with waits under a deadline.

    Args:
        num_events: events are ints in ``[0, num_events)``.
        rank: this process's rank, named in errors.
    """

    def __init__(self, num_events: int, rank: int = 0) -> None:
        self.num_events = check_positive_int("num_events", num_events)
        self.rank = rank
        self._counts = [0] * num_events
        self._cond = threading.Condition()
        self._error: str | None = None
        self._listeners: list[Callable[[int, int], None]] = []

    def add_listener(self, callback: Callable[[int, int], None]) -> None:
        """Call ``callback(event, count)`` after every bump (the Subscriber's notification of
        a scheduler, FlashDMoE Alg. 2): on the bumping thread, outside the counters' lock, so it
        must be quick (enqueue a task, nothing more)."""
        self._listeners.append(callback)

    def check_event(self, name: str, event: int) -> int:
        """``event`` is a valid event id; returns it."""
        return check_int(name, event, minimum=0, maximum=self.num_events - 1)

    def bump(self, event: int, by: int = 1) -> None:
        """Add ``by`` to ``event``'s counter and wake its waiters."""
        self.check_event("event", event)
        check_positive_int("by", by)  # counters only go up
        self.bump_unchecked(event, by)

    def bump_unchecked(self, event: int, by: int = 1) -> None:
        """:meth:`bump` without validating the arguments: for executors whose event ids were
        validated once with their plan (the per-task hot path)."""
        with self._cond:
            self._counts[event] += by
            count = self._counts[event]
            self._cond.notify_all()
        for callback in self._listeners:
            callback(event, count)

    @property
    def counts_view(self) -> list[int]:
        """The live counts (read-only by contract): executors read a count without the lock,
        which is safe because counts only go up; wait with :meth:`wait` when it is short."""
        return self._counts

    def count(self, event: int) -> int:
        """The current count of ``event``."""
        with self._cond:
            return self._counts[self.check_event("event", event)]

    def fail(self, message: str) -> None:
        """Make every current and later :meth:`wait` raise ``CollectiveError(message)``."""
        with self._cond:
            self._error = self._error or message
            self._cond.notify_all()

    def wait(self, event: int, threshold: int, timeout_s: float) -> int:
        """Block until ``event``'s count is >= ``threshold``; returns the count.

        Raises:
            CollectiveError: the deadline passed (naming event, threshold and the count
                reached), or the transport failed.
        """
        self.check_event("event", event)
        check_int("threshold", threshold, minimum=0)
        check_positive("timeout_s", timeout_s)
        return self.wait_unchecked(event, threshold, timeout_s)

    def wait_unchecked(self, event: int, threshold: int, timeout_s: float) -> int:
        """:meth:`wait` without validating the arguments (see :meth:`bump_unchecked`)."""
        count = self._counts[event]  # counts only go up: a reached threshold stays reached
        if count >= threshold:
            return count
        with self._cond:
            if self._counts[event] >= threshold:  # already there: no predicate machinery
                return self._counts[event]
            done = self._cond.wait_for(
                lambda: self._counts[event] >= threshold or self._error is not None, timeout_s
            )
            count = self._counts[event]
            if count >= threshold:
                return count
            where = (
                f"event {event} on rank {self.rank}: threshold {threshold}, count reached {count}"
            )
            if not done:
                raise CollectiveError(
                    f"wait for {where} timed out after {timeout_s:g}s: a peer died, hung, or "
                    "never put to this event"
                )
            raise CollectiveError(f"wait for {where} failed: {self._error}")


class Transport(ABC):
    """Moves a tile into a peer's :class:`SymmetricBuffer` and signals its counter there.

    An implementation must bump the destination's counter only after the whole tile is
    visible in the destination's buffer, and keep puts of one (source, destination) pair in
    order. ``put`` may return before the data left; ``flush`` waits for every put issued.
    """

    rank: int
    world_size: int

    @abstractmethod
    def put(self, src: torch.Tensor, dst_rank: int, offset: int, event: int) -> None:
        """Start writing flat ``src`` at ``offset`` of ``dst_rank``'s buffer, then signal."""

    @abstractmethod
    def flush(self) -> None:
        """Wait (under the deadline) until every put issued has left this rank."""

    @abstractmethod
    def close(self) -> None:
        """Collective shutdown: every rank calls it; no put may follow."""


class GlooTransport(Transport):
    """Point-to-point gloo messages and one receiving thread (see the module docstring).

    Collective: every rank constructs it, in the same order relative to other groups.

    Args:
        buffer: this rank's receive buffer.
        counters: this rank's event counters.
        timeout_s: deadline of sends, of a payload after its header, and of ``close``.
        idle_timeout_s: how long the receiving thread may wait for the next header (the
            timeout of the transport's process group); a window idle longer breaks.
    """

    def __init__(
        self,
        buffer: SymmetricBuffer,
        counters: EventCounters,
        timeout_s: float,
        idle_timeout_s: float = 24 * 3600.0,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("GlooTransport needs an initialised torch.distributed (gloo) world")
        self.buffer, self.counters = buffer, counters
        self.timeout_s = check_positive("timeout_s", timeout_s)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.traffic = Traffic([0] * self.world_size)
        self.idle_timeout_s = check_positive("idle_timeout_s", idle_timeout_s)
        self.group = dist.new_group(
            list(range(self.world_size)),
            timeout=datetime.timedelta(seconds=self.idle_timeout_s),
            backend="gloo",
        )
        self._check_symmetric()
        self._pending: list[tuple[Any, torch.Tensor]] = []
        # A put's header and payload leave back to back: two worker threads putting at once
        # must not interleave them (the receiver pairs headers and payloads in order).
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._subscribe, name=f"moesaic-onesided-recv-{self.rank}", daemon=True
        )
        self._thread.start()

    def _check_symmetric(self) -> None:
        mine = torch.tensor([self.buffer.numel, self.buffer.data.element_size()])
        lo, hi = mine.clone(), mine.clone()
        for t, op in ((lo, dist.ReduceOp.MIN), (hi, dist.ReduceOp.MAX)):
            work = dist.all_reduce(t, op=op, group=self.group, async_op=True)
            wait_work(work, f"symmetric buffer check failed on rank {self.rank}", self.timeout_s)
        if not torch.equal(lo, hi):
            raise ValueError(
                f"the buffer must have the same numel and element size on every rank: rank "
                f"{self.rank} has {mine.tolist()}, the world ranges {lo.tolist()}..{hi.tolist()}"
            )

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        try:
            work = dist.isend(tensor, dst, group=self.group, tag=tag)
        except RuntimeError as exc:  # gloo: a peer's closed connection is seen at once
            raise CollectiveError(
                f"one-sided send from rank {self.rank} to rank {dst} failed: the peer died. "
                f"Cause: {str(exc).splitlines()[0][:300]}"
            ) from exc
        self._pending.append((work, tensor))
        if len(self._pending) > _MAX_PENDING:
            self._wait_sends(self._pending[: len(self._pending) // 2])
            del self._pending[: len(self._pending) // 2]

    def _wait_sends(self, pending: list[tuple[Any, torch.Tensor]]) -> None:
        for work, _ in pending:
            wait_work(work, f"one-sided put failed on rank {self.rank}", self.timeout_s)

    def put(self, src: torch.Tensor, dst_rank: int, offset: int, event: int) -> None:
        if self._closed:
            raise ValueError("put after close: the window is closed")
        header = torch.tensor([_PUT, self.rank, offset, src.numel(), event], dtype=torch.int64)
        with self._lock:
            self._send(header, dst_rank, _HEADER_TAG)
            self._send(src, dst_rank, _PAYLOAD_TAG)
            self.traffic.collectives += 1  # here: puts issued
            self.traffic.peer_bytes_P[dst_rank] += src.numel() * src.element_size()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        self._wait_sends(pending)

    def _subscribe(self) -> None:
        """The receiving thread: header from any peer, its payload into the buffer, signal."""
        stopped: set[int] = set()
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        try:
            while len(stopped) < self.world_size - 1:
                idle = dist.irecv(header, None, group=self.group, tag=_HEADER_TAG)
                wait_work(idle, f"no header reached rank {self.rank}", self.idle_timeout_s)
                kind, source, offset, numel, event = header.tolist()
                if kind == _STOP:
                    stopped.add(source)
                    continue
                view = self.buffer.data[offset : offset + numel]
                work = dist.irecv(view, source, group=self.group, tag=_PAYLOAD_TAG)
                wait_work(
                    work,
                    f"payload of a put from rank {source} (event {event}) did not arrive on "
                    f"rank {self.rank}",
                    self.timeout_s,
                )
                self.counters.bump(event)
        except Exception as exc:  # gloo errors, deadlines, a listener that raised: all fatal
            cause = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            self.counters.fail(f"the receiving thread stopped: {cause}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A failed send (dead peer) raises here at once; the receiving thread is a daemon.
        stop = torch.tensor([_STOP, self.rank, 0, 0, 0], dtype=torch.int64)
        with self._lock:
            for peer in range(self.world_size):
                if peer != self.rank:
                    self._send(stop, peer, _HEADER_TAG)
        self.flush()
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise CollectiveError(
                f"close on rank {self.rank} timed out after {self.timeout_s:g}s: a peer did not "
                "close its window (died, hung, or skipped close)"
            )


class SoloTransport(Transport):
    """A world of one process (torch.distributed not running): every put is a self-put, which
    the window does as a local copy, so nothing ever reaches this transport."""

    def __init__(self) -> None:
        self.rank, self.world_size = 0, 1

    def put(self, src: torch.Tensor, dst_rank: int, offset: int, event: int) -> None:
        raise ValueError(f"dst_rank ({dst_rank}) must be 0 in a world of one process")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class SymmetricMemoryTransport(Transport):
    """Seam for CUDA puts through ``torch.distributed._symmetric_memory`` or NVSHMEM.

    Where it goes: allocate the buffer with ``symm_mem.empty`` and ``rendezvous`` it, write a
    tile with a copy into the peer's mapped buffer (or an NVSHMEM put) followed by a signal put
    on the peer's counter word (release ordering), and make ``EventCounters.wait`` a
    ``wait_signal`` on the local counter words. Not implemented: constructing it raises.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "SymmetricMemoryTransport (CUDA symmetric memory / NVSHMEM one-sided puts) is not "
            "implemented in moesaic; use GlooTransport (transport='gloo') on CPU"
        )

    def put(self, src: torch.Tensor, dst_rank: int, offset: int, event: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class OneSidedWindow:
    """A symmetric receive buffer with event counters, written by one-sided puts.

    Collective to open and to close (every rank, same arguments). Use as a context manager.

    Args:
        numel: elements of the receive buffer (the same on every rank).
        num_events: number of event counters (events are ``0 .. num_events - 1``).
        dtype: element type of the buffer and of every tile.
        timeout_s: deadline of sends, of a started payload and of ``close``; the default
            deadline of :meth:`wait`.
        transport: ``"gloo"`` (CPU point-to-point; a world of one process when
            torch.distributed is not running) or ``"symmetric_memory"`` (not implemented).
    """

    def __init__(
        self,
        numel: int,
        num_events: int,
        dtype: torch.dtype = torch.float32,
        timeout_s: float = 60.0,
        transport: str = "gloo",
    ) -> None:
        self.buffer = SymmetricBuffer(numel, dtype)
        self.timeout_s = check_positive("timeout_s", timeout_s)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.counters = EventCounters(num_events, rank)
        self.transport: Transport
        if transport == "gloo" and not (dist.is_available() and dist.is_initialized()):
            self.transport = SoloTransport()
        elif transport == "gloo":
            self.transport = GlooTransport(self.buffer, self.counters, timeout_s)
        elif transport == "symmetric_memory":
            self.transport = SymmetricMemoryTransport()
        else:
            raise ValueError(f"transport must be 'gloo' or 'symmetric_memory', got {transport!r}")
        self.rank, self.world_size = self.transport.rank, self.transport.world_size

    def put_with_signal(
        self, src: torch.Tensor, dst_rank: int, dst_region: Sequence[int], dst_event: int
    ) -> None:
        """Write ``src`` into ``dst_rank``'s buffer at ``dst_region``; then signal ``dst_event``.

        The destination's counter ``dst_event`` goes up by one only after all of ``src`` is
        written there. Returns once the put is issued: ``src`` must not change until
        :meth:`flush` (or :meth:`close`) returns. Everything is validated before anything is sent.

        Args:
            src: the tile (any shape, contiguous or not; sent flat), of the buffer's dtype.
            dst_rank: the destination rank (may be this rank: a local copy).
            dst_region: ``(offset, numel)`` in elements; ``src.numel() <= numel``, and the tile
                fills the region's first ``src.numel()`` elements.
            dst_event: the destination's counter to bump.

        Raises:
            ValueError: an unknown rank, a region outside the buffer, a tile larger than its
                region or of another dtype, an unknown event.
        """
        check_int("dst_rank", dst_rank, minimum=0, maximum=self.world_size - 1)
        offset, numel = self.buffer.check_region("dst_region", dst_region)
        self.counters.check_event("dst_event", dst_event)
        if not isinstance(src, torch.Tensor):
            raise ValueError(f"src must be a tensor, got {type(src).__name__}")
        if src.dtype != self.buffer.dtype:
            raise ValueError(f"src dtype ({src.dtype}) must be the buffer's ({self.buffer.dtype})")
        if src.numel() > numel:
            raise ValueError(
                f"src ({src.numel()} elements) must fit in dst_region ({numel} elements)"
            )
        flat = src.detach().reshape(-1).contiguous()
        if dst_rank == self.rank:
            self.buffer.data[offset : offset + flat.numel()].copy_(flat)
            self.counters.bump(dst_event)
            return
        self.transport.put(flat, dst_rank, offset, dst_event)

    def wait(self, event: int, threshold: int, timeout_s: float | None = None) -> int:
        """Block until this rank's ``event`` count reaches ``threshold`` (see EventCounters)."""
        return self.counters.wait(event, threshold, timeout_s or self.timeout_s)

    def flush(self) -> None:
        """Wait until every put this rank issued has left it (under the deadline)."""
        self.transport.flush()

    def close(self) -> None:
        """Collective: flush, tell every peer, stop the receiving thread (under the deadline)."""
        self.transport.close()

    def __enter__(self) -> OneSidedWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
