"""Remote puts through torch's symmetric memory: the taskflow runtime's transport on CUDA.

FlashDMoE (paper 003, §4-5) writes a tile straight into the peer's symmetric heap and then
sets a per-tile flag there; the peer's Subscriber turns flags into tasks. On CUDA torch offers
that heap: ``torch.distributed._symmetric_memory.empty`` allocates a buffer and ``rendezvous``
(a collective of the group) maps every rank's buffer into every process, where
``_SymmetricMemory.get_buffer(peer, sizes, dtype, storage_offset)`` is a tensor over the peer's
memory. :class:`SymmetricMemoryChannel` is the :class:`~moesaic.comm.channel.PutTransport` on
it; what it does is this module, what needs a device is :class:`CudaSymmetricMemory` (the
primitives), so a CPU test runs the channel with host stand-ins for the primitives alone.

Per window (``window(numel, dtype, device, num_events)``, once per layer and shape bucket, on
every rank in the same order): the receive window and an int32 signal array (``comm.signals``:
one row ``[epoch, puts, events...]`` per source rank), both from ``symm_mem.empty`` and both
``rendezvous``-ed, zeroed before the rendezvous.

* ``put(src, dst, offset, events)``: on the channel's put stream (after the caller's current
  stream, so the tile's producer is done) copy ``src`` into ``dst``'s window at ``offset``,
  then write ``dst``'s signal words with ``_SymmetricMemory.stream_write_value32`` (a
  ``cuStreamWriteValue32``, ordered after the copy with its default memory barrier): each
  event's running total, then the puts total. One writer per word that only writes larger
  totals: increments without remote atomics (``comm.signals``).
* ``begin(buffer, counters, expected)`` is the **step fence**: it writes this step's number into
  every rank's epoch word (on the put stream, after the current stream: the window's readers of
  the step before come first) and waits on the host, under the deadline, until every rank's
  epoch reached it; puts of the step follow. It then starts the Subscriber, a host thread that
  polls the rank's signal array and bumps the step's ``EventCounters`` by what moved.
* ``finish()`` waits (deadline) until the put stream drained and the Subscriber saw the
  ``expected`` puts (then one more snapshot, so every event word written before them is in).

A rank that misses the fence or the puts is a :class:`CollectiveError` naming the ranks that
lag (the epoch words say who began; the puts words say who delivered how many); a channel
that failed is broken and refuses further steps.

Why not the other primitives: ``symm_mem.put_signal`` / ``wait_signal`` dispatch to the NCCL
backend only in torch 2.13 and signal a whole peer, not an event; ``_SymmetricMemory.barrier``
and ``wait_signal`` wait on the device and trap the CUDA context on timeout instead of raising,
so the fence waits on the host, where a late peer can be named.

Nothing here has run on a GPU yet (no GPU was available when it was written): the CPU tests
run every line of :class:`SymmetricMemoryChannel` with host primitives;
``tests/gpu/test_gpu_symmetric_put.py`` is the CUDA check, a world-of-one self-put.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moesaic.checks import check_int, check_one_of, check_positive
from moesaic.comm.collectives import CollectiveError, EPGroup
from moesaic.comm.counters import EventCounters
from moesaic.comm.signals import TRANSPORTS, WORD, Arrivals, SignalLayout, SignalLedger
from moesaic.trace import Recorder

__all__ = [
    "TRANSPORTS",
    "CudaSymmetricMemory",
    "SymmetricMemoryChannel",
    "SymmetricPrimitives",
    "check_one_rank_per_device",
    "pick_transport",
    "symmetric_available",
]

_POLL_MAX_S = 200e-6  # the Subscriber's longest sleep between snapshots that showed nothing new


def symmetric_available(group: EPGroup) -> bool:
    """Whether torch's symmetric memory can serve ``group``: CUDA, an initialised
    torch.distributed (rendezvous needs a process group) and the module in this build."""
    if not (torch.cuda.is_available() and group.active):
        return False
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def pick_transport(mode: str, device_type: str, ranks: int, symmetric_ready: bool) -> str | None:
    """The one rule that picks a taskflow step's transport: ``"symmetric"``, ``"gloo"`` or
    None (a group of one with nothing to put).

    Args:
        mode: one of :data:`TRANSPORTS` (``TaskflowRuntime(transport=...)``).
        device_type: the step's tensors' device type.
        ranks: the EP group's size.
        symmetric_ready: :func:`symmetric_available` for the group.
    """
    check_one_of("transport", mode, TRANSPORTS)
    if mode == "symmetric":
        if device_type != "cuda" or not symmetric_ready:
            raise ValueError(
                f"transport 'symmetric' needs CUDA tensors and torch's symmetric memory (CUDA "
                f"and an initialised torch.distributed); got {device_type} tensors, symmetric "
                f"memory {'available' if symmetric_ready else 'unavailable'}"
            )
        return "symmetric"
    if mode == "auto" and device_type == "cuda" and symmetric_ready and ranks > 1:
        return "symmetric"
    if ranks == 1:
        return None
    if device_type != "cpu":
        raise ValueError(
            f"the gloo channel takes CPU tensors only (got {device_type} tensors on {ranks} "
            f"ranks, transport {mode!r}): device tiles between ranks need torch's symmetric "
            "memory, transport 'symmetric' or 'auto' on CUDA with an initialised "
            f"torch.distributed ({'available' if symmetric_ready else 'unavailable'} here), "
            "or dispatcher 'dropless'"
        )
    return "gloo"


def check_one_rank_per_device(places: Sequence[tuple[str, int | None]]) -> None:
    """Refuse a group whose ranks share a GPU. ``places``: each rank's (host, device index).
    Symmetric memory maps each peer's allocation into this process, one peer per device: two
    ranks on one GPU (several ranks over gloo on a one-GPU machine) make torch's rendezvous
    fail with "allocations from overlapping devices"; this names the ranks and the way out."""
    seen: dict[tuple[str, int | None], int] = {}
    for rank, place in enumerate(places):
        if place in seen:
            host, index = place
            raise ValueError(
                f"symmetric memory needs one GPU per rank: ranks {seen[place]} and {rank} share "
                f"cuda:{index} on {host}; give each rank its own GPU (LOCAL_RANK), or use "
                "dispatcher 'dropless'"
            )
        seen[place] = rank


class SymmetricPrimitives(Protocol):
    """The device operations :class:`SymmetricMemoryChannel` needs, in issue order on one
    put stream (a CPU stand-in does each at once)."""

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed flat buffer that :meth:`peers` can map."""
        ...

    def peers(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor``, as tensors this process can write (a collective)."""
        ...

    def after_compute(self, device: torch.device) -> None:
        """Later copies and writes wait for the work issued so far on the caller's stream."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (a peer's memory)."""
        ...

    def write(self, words: torch.Tensor, index: int, value: int) -> None:
        """Write the 32-bit ``value`` (0 <= value < 2**32) at ``index`` of int32 ``words``,
        after every earlier copy and write is visible."""
        ...

    def read(self, words: torch.Tensor) -> list[int]:
        """A host snapshot of int32 ``words`` (this rank's own signal array)."""
        ...

    def drained(self) -> bool:
        """Whether every copy and write issued so far has completed."""
        ...


class CudaSymmetricMemory:
    """:class:`SymmetricPrimitives` on CUDA with ``torch.distributed._symmetric_memory``:
    ``empty`` and ``rendezvous`` (over ``group``'s process group), ``get_buffer`` for the
    peers' memory, ``_SymmetricMemory.stream_write_value32`` for the signal words; copies and
    writes on one put stream per device, snapshots on a poll stream."""

    def __init__(self, group: EPGroup) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm = symm_mem
        pg = group.group if group.group is not None else dist.group.WORLD
        if pg is None:
            raise ValueError("symmetric memory needs an initialised torch.distributed")
        self._pg = pg
        self._streams: dict[torch.device, tuple[Any, Any]] = {}  # device -> (put, poll)
        self._handles: list[Any] = []  # the rendezvous handles keep the mappings alive
        self._checked: set[torch.device] = set()  # devices whose group placement was checked

    def _pair(self, device: torch.device) -> tuple[Any, Any]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device not in self._checked:  # one collective per device, before the first buffer
            places: list[Any] = [None] * dist.get_world_size(self._pg)
            dist.all_gather_object(places, (socket.gethostname(), device.index), group=self._pg)
            check_one_rank_per_device(places)
            self._checked.add(device)
        tensor = self._symm.empty(numel, dtype=dtype, device=device)
        tensor.zero_()
        torch.cuda.synchronize(device)  # zero before the rendezvous lets any peer write
        return tensor

    def peers(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        handle = self._symm.rendezvous(tensor, self._pg)
        self._handles.append(handle)
        size = (tensor.numel(),)
        return [handle.get_buffer(p, size, tensor.dtype, 0) for p in range(handle.world_size)]

    def after_compute(self, device: torch.device) -> None:
        self._pair(device)[0].wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._pair(dst.device)[0]):
            dst.copy_(src, non_blocking=True)

    def write(self, words: torch.Tensor, index: int, value: int) -> None:
        from torch._C._distributed_c10d import _SymmetricMemory

        with torch.cuda.stream(self._pair(words.device)[0]):
            # The op takes a flat, contiguous uint32 tensor only (symm_mem::stream_write_value32_
            # refuses int32); the signal words stay int32 for the host's reads: the same bits.
            _SymmetricMemory.stream_write_value32(words.view(torch.uint32), index, value)

    def read(self, words: torch.Tensor) -> list[int]:
        with torch.cuda.stream(self._pair(words.device)[1]):
            return words.to("cpu").tolist()

    def drained(self) -> bool:
        return all(put.query() for put, _ in self._streams.values())


@dataclass(slots=True)
class _Window:
    """One receive window: this rank's data and signals, every rank's as mapped here."""

    data: torch.Tensor
    data_P: list[torch.Tensor]
    signals: torch.Tensor
    signals_P: list[torch.Tensor]
    layout: SignalLayout
    arrivals: Arrivals
    ledger: SignalLedger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = SignalLedger(self.layout.ranks)


class SymmetricMemoryChannel:
    """One-sided puts with multi-event signals into the peers' symmetric memory.

    Args:
        group: the expert-parallel group; ranks are its ranks. Self-puts are allowed (a copy
            into this rank's own window, signalled like any other).
        timeout_s: deadline of the step fence, of the put stream and of ``finish``.
        primitives: the device operations; default :class:`CudaSymmetricMemory` over
            ``group``'s process group.
    """

    def __init__(
        self, group: EPGroup, timeout_s: float, primitives: SymmetricPrimitives | None = None
    ) -> None:
        self.timeout_s = check_positive("timeout_s", timeout_s)
        self.group = group
        self.rank, self.size = group.rank, group.size
        self.primitives: SymmetricPrimitives = primitives or CudaSymmetricMemory(group)
        self._windows: dict[int, _Window] = {}  # by the window's data pointer
        self._lock = threading.Lock()
        self._active: _Window | None = None
        self._counters: EventCounters | None = None
        self._expected = 0
        self._step = 0
        self._pending: list[torch.Tensor] = []  # sources kept alive until the stream drained
        self._targets: set[int] = set()  # ranks this step put to
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._broken: str | None = None
        self.puts = 0  # puts issued, all steps
        self.puts_P = [0] * self.size  # puts to each rank, all steps
        self.bytes_P = [0] * self.size  # payload bytes to each rank, all steps

    @property
    def header_bytes(self) -> int:
        """Bytes a put writes beyond its payload, its event words aside: the puts word."""
        return 4

    # -- windows --------------------------------------------------------------------------------
    def window(
        self, numel: int, dtype: torch.dtype, device: torch.device, num_events: int
    ) -> torch.Tensor:
        """A zeroed flat receive window of ``numel`` elements in symmetric memory, with its
        signal array for events ``[0, num_events)`` (the most of any rank). A collective of the
        group, called on every rank in the same order with the same ``numel``."""
        check_int("numel", numel, minimum=1)
        check_int("num_events", num_events, minimum=1)
        agreed = self.group.control_tensor([numel, -numel, num_events])
        self.group.all_reduce(agreed, op=dist.ReduceOp.MAX, what="symmetric window size")
        most, least, events = int(agreed[0]), -int(agreed[1]), int(agreed[2])
        if most != least:
            raise ValueError(
                f"numel ({numel} on rank {self.rank}) must be the same on every rank of a "
                f"symmetric window: the ranks asked for {least} to {most} elements"
            )
        layout = SignalLayout(self.size, events)
        data = self.primitives.allocate(numel, dtype, device)
        data_P = self.primitives.peers(data)
        signals = self.primitives.allocate(layout.numel, torch.int32, device)
        signals_P = self.primitives.peers(signals)
        w = _Window(data, data_P, signals, signals_P, layout, Arrivals(layout))
        self._windows[data.data_ptr()] = w
        return data

    def window_bytes(self) -> int:
        """Bytes of every window and signal array allocated so far (this rank's share)."""
        return sum(
            w.data.numel() * w.data.element_size() + 4 * w.signals.numel()
            for w in self._windows.values()
        )

    # -- one step -------------------------------------------------------------------------------
    def begin(
        self,
        buffer: torch.Tensor,
        counters: EventCounters,
        expected: int,
        recorder: Recorder | None = None,
    ) -> None:
        """The step fence, then receive ``expected`` puts into ``buffer`` (a window of this
        channel) and turn their signals into bumps of ``counters``."""
        if self._broken:
            raise CollectiveError(f"the put channel is broken by an earlier error: {self._broken}")
        if self._active is not None:
            raise ValueError("begin called twice without finish")
        w = self._windows.get(buffer.data_ptr())
        if w is None or w.data is not buffer:
            raise ValueError(
                "buffer must be a window of this channel (SymmetricMemoryChannel.window): "
                "symmetric memory is mapped once, when it is allocated"
            )
        self._expected = check_int("expected", expected, minimum=0)
        if counters.num_events > w.layout.events:
            raise ValueError(
                f"counters have {counters.num_events} events, the window's signals "
                f"{w.layout.events} (window(num_events=...) too small)"
            )
        self._active, self._counters = w, counters
        self._step = (self._step + 1) % WORD
        w.arrivals.begin_step()
        self._stop.clear()
        self._done.clear()
        try:
            self.primitives.after_compute(w.data.device)
            index = w.layout.epoch_index(self.rank)
            for p in range(self.size):
                self.primitives.write(w.signals_P[p], index, w.ledger.set(p, index, self._step))
            deadline = time.monotonic() + self.timeout_s
            step = self._step
            self._poll_until(w, counters, lambda: not w.arrivals.behind(step), deadline)
        except Exception as exc:
            self._fail(f"the step fence failed: {_first_line(exc)}")
            self._active = self._counters = None
            raise
        behind = w.arrivals.behind(self._step)
        if behind:
            message = (
                f"rank {self.rank} waited {self.timeout_s:g}s at the step fence for rank(s) "
                f"{behind}: a peer died, hung or runs another plan"
            )
            self._fail(message)
            self._active = self._counters = None
            raise CollectiveError(message)
        if expected:
            self._thread = threading.Thread(
                target=self._subscribe,
                args=(w, counters, recorder),
                name=f"moesaic-symm-subscriber-{self.rank}",
                daemon=True,
            )
            self._thread.start()
        else:
            self._done.set()

    def put(self, src: torch.Tensor, dst_rank: int, offset: int, events: Sequence[int]) -> None:
        """Write flat contiguous ``src`` at element ``offset`` of ``dst_rank``'s window, then
        signal each of ``events`` there (returns once issued)."""
        w = self._active
        if w is None:
            raise ValueError("put outside a step: call begin first")
        check_int("dst_rank", dst_rank, 0, self.size - 1)
        n = src.numel()
        check_int("offset", offset, 0, w.data.numel() - n)
        if src.dtype != w.data.dtype or src.device != w.data.device:
            raise ValueError(
                f"src ({src.dtype} on {src.device}) must match the window ({w.data.dtype} on "
                f"{w.data.device})"
            )
        words = [w.layout.event_index(self.rank, ev) for ev in events]  # checks each event
        puts_word = w.layout.puts_index(self.rank)
        with self._lock:
            if self._broken:
                raise CollectiveError(f"the put channel is broken: {self._broken}")
            try:
                self.primitives.after_compute(src.device)
                if n:
                    self.primitives.copy(w.data_P[dst_rank][offset : offset + n], src.reshape(-1))
                peer = w.signals_P[dst_rank]
                for k in words:
                    self.primitives.write(peer, k, w.ledger.next(dst_rank, k))
                self.primitives.write(peer, puts_word, w.ledger.next(dst_rank, puts_word))
            except RuntimeError as exc:
                self._fail(f"a put to rank {dst_rank} failed")
                raise CollectiveError(
                    f"taskflow put from rank {self.rank} to rank {dst_rank} failed: "
                    f"{_first_line(exc)}"
                ) from exc
            self._pending.append(src)
            self._targets.add(dst_rank)
            nbytes = n * src.element_size()
            self.puts += 1
            self.puts_P[dst_rank] += 1
            self.bytes_P[dst_rank] += nbytes
            if dst_rank != self.rank:
                self.group.count_sent(dst_rank, nbytes + self.header_bytes)

    def finish(self) -> None:
        """Wait until this rank's puts completed and its ``expected`` puts arrived (under the
        deadline); raises :class:`CollectiveError` naming the ranks behind."""
        w = self._active
        try:
            if w is None:
                raise ValueError("finish without begin")
            deadline = time.monotonic() + self.timeout_s
            while not self.primitives.drained():
                if self._broken or time.monotonic() > deadline:
                    break
                time.sleep(_POLL_MAX_S)
            drained = self.primitives.drained()
            if drained:
                self._pending.clear()
            elif not self._broken:
                message = (
                    f"puts from rank {self.rank} to rank(s) {sorted(self._targets)} did not "
                    f"complete within {self.timeout_s:g}s"
                )
                self._fail(message)
                raise CollectiveError(message)
            self._done.wait(max(0.0, deadline - time.monotonic()) if not self._broken else 0)
            if not self._done.is_set() and not self._broken:
                got = w.arrivals.step_puts_P()
                message = (
                    f"taskflow puts to rank {self.rank} did not all arrive within "
                    f"{self.timeout_s:g}s: {sum(got)} of {self._expected} (per source rank "
                    f"{got}); a peer died, hung or runs another plan"
                )
                self._fail(message)
                raise CollectiveError(message)
            if self._broken:
                raise CollectiveError(f"taskflow puts failed on rank {self.rank}: {self._broken}")
        finally:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(1.0)
            self._thread = None
            self._active = self._counters = None
            self._targets.clear()

    def fail(self, message: str) -> None:
        """Mark the channel broken and wake every waiter of the step (a worker failed)."""
        self._fail(message)

    # -- internals ------------------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self._broken = self._broken or message
        self._stop.set()
        if self._counters is not None:
            self._counters.fail(message)

    def _poll(self, w: _Window, counters: EventCounters) -> bool:
        """One snapshot of this rank's signals into the step's counters; whether any moved."""
        moved = w.arrivals.absorb(self.primitives.read(w.signals))
        for event, by in moved:
            counters.bump(event, by)
        return bool(moved)

    def _poll_until(
        self, w: _Window, counters: EventCounters, ready: Callable[[], bool], deadline: float
    ) -> None:
        """Snapshots until ``ready()``, the deadline, a failure or a stop."""
        pause = 0.0
        while True:
            moved = self._poll(w, counters)
            if ready() or self._stop.is_set() or time.monotonic() > deadline:
                return
            pause = 0.0 if moved else min(_POLL_MAX_S, 2 * pause + 10e-6)
            time.sleep(pause)

    def _subscribe(self, w: _Window, counters: EventCounters, recorder: Recorder | None) -> None:
        """The Subscriber: signals into counters until the step's puts are all in."""
        expected, start = self._expected, time.perf_counter()
        try:
            ready = lambda: w.arrivals.step_puts() >= expected  # noqa: E731
            self._poll_until(w, counters, ready, float("inf"))
            if self._stop.is_set():
                return
            self._poll(w, counters)  # event words written before the last puts word
            got = w.arrivals.step_puts()
            if got > expected:
                raise CollectiveError(
                    f"rank {self.rank} received {got} puts, expected {expected}: a peer runs "
                    "another plan"
                )
            if recorder is not None:
                recorder.add("subscriber", f"{got} puts", start, time.perf_counter())
            self._done.set()
        except Exception as exc:  # a listener that raised, an unknown event: fatal
            self._fail(f"the receiving thread stopped: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:300]
