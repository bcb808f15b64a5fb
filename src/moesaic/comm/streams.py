"""Device streams and events behind one small interface, with a CPU stand-in.

The code NCCL takes enqueues work on side streams, makes streams wait for each other and for
collectives, and times transfers with events. :class:`CudaStreams` is that interface over
``torch.cuda``; :class:`HostStreams` is its stand-in on a CPU, so that a gloo world on CPU runs
exactly the branches an NCCL world runs (``EPGroup.on_stream`` true, ``Pending.wait`` a stream
wait, the hybrid prefetcher's ``_run_on_stream``, the pool's event-timed spans):

* **issue order is execution order.** A CPU runs every kernel when it is issued, so work
  "enqueued" on a stand-in stream has run, in issue order, by the time the host goes on;
* **waits are real dependencies.** A stream's wait for a collective (``wait_work``) blocks the
  host until the collective is done, under the group's deadline (on a device the stream waits
  and the host goes on; the stand-in's stricter wait keeps every read after it correct, and a
  dead peer is still a ``CollectiveError``). Waits between streams (``wait_stream``,
  ``wait_event``) are then already met; an event waited for that was never recorded raises;
* **events record host timestamps** (``time.perf_counter``), so ``elapsed_time`` of two events
  is the host time between their records;
* **what a device would race on is found** (``record_streams(check_hazards=True)``): each
  stand-in stream counts the kernels issued on it and keeps a vector clock of what it waited
  for (``wait_stream``, ``wait_event``: an event carries its stream's clock at ``record``); a
  dispatch mode notes which stream wrote each storage last, and a kernel on another stream
  that reads it before waiting for that write raises :class:`StreamHazardError`, where a GPU
  would read stale or half-written data (as HybridEP's forward would, taking prefetched
  experts without waiting for the side stream's event).

Which one a tensor's collectives use is :func:`device_streams`: ``torch.cuda`` for a CUDA
tensor, the stand-in for a CPU tensor when ``MOESAIC_STANDIN_STREAMS=1`` (read on every call, as
``MOESAIC_NO_SHORTCUTS``: a test may switch it between two runs in one process); a CPU tensor
without it has no device streams (the gloo path: host waits under the deadline, a thread for
the prefetch). A stand-in keeps, when asked (:func:`record_streams`, or an instance's ``log``),
what was issued on which stream in issue order, so a test can check the device order.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "ENV_VAR",
    "CudaStreams",
    "HostEvent",
    "HostStream",
    "HostStreams",
    "StreamHazardError",
    "Streams",
    "device_streams",
    "record_streams",
    "standin_streams_enabled",
]

# Set to 1: collectives of CPU tensors on an initialised world run the device-stream branches
# through the stand-in (``HostStreams``).
ENV_VAR = "MOESAIC_STANDIN_STREAMS"


def standin_streams_enabled() -> bool:
    """Whether CPU tensors take the device-stream branches through :class:`HostStreams`
    (``MOESAIC_STANDIN_STREAMS=1``)."""
    return os.environ.get(ENV_VAR, "0") not in ("", "0")


class Streams(Protocol):
    """Where device work is enqueued: the current stream, side streams, events, waits."""

    def current(self) -> Any:
        """The stream the model computes on."""
        ...

    def new_stream(self) -> Any:
        """A side stream (``wait_stream(other)``, ``wait_event(event)``)."""
        ...

    def use(self, stream: Any) -> Any:
        """A context manager making ``stream`` current."""
        ...

    def event(self, *, timing: bool = False) -> Any:
        """An event (``record(stream=None)``, ``wait(stream=None)``, ``synchronize()``,
        ``query()``, ``elapsed_time(end)`` in ms when ``timing``)."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor`` (allocated on another stream) is used on ``stream``: the caching
        allocator must not reuse its memory before ``stream`` is done with it."""
        ...

    def wait_work(self, work: Any, timeout_s: float) -> None:
        """The current stream waits for an asynchronous collective's ``work`` (a
        ``dist.Work``); ``timeout_s``: the group's deadline (see the implementations)."""
        ...


class CudaStreams:
    """:class:`Streams` over ``torch.cuda``."""

    def current(self) -> Any:
        return torch.cuda.current_stream()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self, *, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def wait_work(self, work: Any, timeout_s: float) -> None:
        """``work.wait()``: the current stream waits and the host returns at once. A
        ``wait(timeout)`` would busy-wait the host until the GPU finished, so the deadline is
        the process group's own (its watchdog aborts a collective that outlives the timeout
        every moesaic group is created with)."""
        del timeout_s
        work.wait()


class StreamHazardError(RuntimeError):
    """A kernel read, on one stream, what another stream wrote without waiting for it."""


class HostStream:
    """A stand-in stream: what was issued on it has run; its waits are checked and logged.

    ``issued`` counts the kernels issued on it (under ``record_streams(check_hazards=True)``)
    and ``waited`` is its vector clock: for each other stream, how many of its kernels this
    one has waited for."""

    def __init__(self, owner: HostStreams, name: str) -> None:
        self.owner, self.name = owner, name
        self.issued = 0
        self.waited: dict[str, int] = {}

    def clock(self) -> dict[str, int]:
        """What work after this point may rely on: its own kernels and what it waited for."""
        return {**self.waited, self.name: self.issued}

    def _merge(self, clock: dict[str, int]) -> None:
        for name, n in clock.items():
            if name != self.name and n > self.waited.get(name, 0):
                self.waited[name] = n

    def wait_stream(self, other: HostStream) -> None:
        self._merge(other.clock())
        self.owner._note("wait_stream", self.name, other.name)

    def wait_event(self, event: HostEvent) -> None:
        if event.stream is None:
            raise RuntimeError("a stream waited for an event that was never recorded")
        self._merge(event.clock)
        self.owner._note("wait_event", self.name, event.stream)

    def synchronize(self) -> None:
        """Everything issued on this stream has run (the host ran it)."""


class HostEvent:
    """A stand-in event: records the host time and the stream it was recorded on."""

    def __init__(self, owner: HostStreams, timing: bool) -> None:
        self.owner, self.timing = owner, timing
        self.stream: str | None = None
        self.clock: dict[str, int] = {}
        self.time_s = 0.0

    def record(self, stream: HostStream | None = None) -> None:
        on = stream or self.owner.current()
        self.stream, self.clock = on.name, on.clock()
        self.time_s = time.perf_counter()
        self.owner._note("record", self.stream, id(self))

    def wait(self, stream: HostStream | None = None) -> None:
        (stream or self.owner.current()).wait_event(self)

    def query(self) -> bool:
        """Whether the work before the record has run (on a host: once recorded)."""
        return self.stream is not None

    def synchronize(self) -> None:
        if self.stream is None:
            raise RuntimeError("synchronize() on an event that was never recorded")

    def elapsed_time(self, end: HostEvent) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs events created with timing=True")
        if self.stream is None or end.stream is None:
            raise RuntimeError("elapsed_time of an event that was never recorded")
        return (end.time_s - self.time_s) * 1e3


class HostStreams:
    """:class:`Streams` on a CPU (see the module docstring).

    ``log`` (None: not kept) lists, in issue order, ``("wait_stream", waiter, waited)``,
    ``("wait_event", waiter, recorded on)``, ``("record", stream, event id)``,
    ``("record_stream", stream, shape)`` and ``("wait_work", stream)``. The current stream is
    per thread, as on a device.

    Args:
        keep_log: keep ``log`` from the start (an instance a test hands to a component);
            the process's own stand-in keeps it only inside :func:`record_streams`.
    """

    def __init__(self, *, keep_log: bool = True) -> None:
        self.log: list[tuple[Any, ...]] | None = [] if keep_log else None
        self._main = HostStream(self, "main")
        self._local = threading.local()
        self._made = 0
        self._made_lock = threading.Lock()

    def _note(self, *entry: Any) -> None:
        log = self.log
        if log is not None:
            log.append(entry)

    def _stack(self) -> list[HostStream]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = [self._main]
        return stack

    def current(self) -> HostStream:
        return self._stack()[-1]

    def new_stream(self) -> HostStream:
        with self._made_lock:
            self._made += 1
            return HostStream(self, f"side{self._made}")

    @contextmanager
    def use(self, stream: HostStream) -> Iterator[HostStream]:
        stack = self._stack()
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    def event(self, *, timing: bool = False) -> HostEvent:
        return HostEvent(self, timing)

    def record_stream(self, tensor: torch.Tensor, stream: HostStream) -> None:
        self._note("record_stream", stream.name, tuple(tensor.shape))

    def wait_work(self, work: Any, timeout_s: float) -> None:
        """The host blocks until ``work`` is done, under ``timeout_s`` (a real dependency:
        whatever the current stream issues next runs after the collective)."""
        self._note("wait_work", self.current().name)
        work.wait(datetime.timedelta(seconds=timeout_s))


@functools.cache
def _process_standin() -> HostStreams:
    """The process's stand-in: one, as a device has one set of streams per process (its log
    is off outside :func:`record_streams`)."""
    return HostStreams(keep_log=False)


def device_streams(device: torch.device) -> Streams:
    """The streams that collectives and side-stream work on ``device`` use.

    Raises:
        ValueError: ``device`` has no streams: a CPU without ``MOESAIC_STANDIN_STREAMS=1``, or
            an accelerator other than CUDA.
    """
    if device.type == "cuda":
        return CudaStreams()
    if device.type == "cpu" and standin_streams_enabled():
        return _process_standin()
    raise ValueError(
        f"no device streams for {device.type} tensors (CUDA has them; a CPU has the stand-in "
        f"with {ENV_VAR}=1)"
    )


@contextmanager
def record_streams(*, check_hazards: bool = False) -> Iterator[list[tuple[Any, ...]]]:
    """``with record_streams() as log:`` what the process's stand-in issues (any thread) is
    appended to ``log`` in issue order (the entries of :class:`HostStreams`).

    Args:
        check_hazards: also check, on this thread, that no kernel reads on one stream what
            another stream wrote before waiting for it (:class:`StreamHazardError`; see the
            module docstring).
    """
    standin = _process_standin()
    saved, standin.log = standin.log, []
    try:
        if check_hazards:
            with _HazardCheck(standin):
                yield standin.log
        else:
            yield standin.log
    finally:
        standin.log = saved


class _HazardCheck(TorchDispatchMode):
    """Each kernel counts as issued on the stand-in's current stream; a tensor it reads that
    another stream wrote after the last point this stream waited for raises; what it returns
    (outputs, and in-place and ``out=`` arguments, which ops return) is written here.

    Read-after-write only: a device could also overwrite what another stream still reads
    (what ``record_stream`` guards for freed memory); a host cannot show that order."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Never runs under torch.compile; torch's default (True) wraps __torch_dispatch__ in
        # dynamo's disable, whose first call imports torch._dynamo: 3.5 s per process here.
        return False

    def __init__(self, streams: HostStreams) -> None:
        super().__init__()
        self.streams = streams
        self.writes: dict[int, tuple[HostStream, int]] = {}  # storage -> (stream, kernel no.)

    @staticmethod
    def _storage(t: torch.Tensor) -> int | None:
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested)
            return None

    def _written(self, t: torch.Tensor, stream: HostStream) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = storage._cdata
        if key not in self.writes:  # forget it when freed: its address may be reused
            weakref.finalize(storage, self.writes.pop, key, None)
        self.writes[key] = (stream, stream.issued)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stream = self.streams.current()
        for t in tree_flatten((args, kwargs))[0]:
            if not isinstance(t, torch.Tensor):
                continue
            write = self.writes.get(self._storage(t) or 0)
            if write is None or write[0] is stream:
                continue
            producer, n = write
            if stream.waited.get(producer.name, 0) < n:
                raise StreamHazardError(
                    f"{func} on stream {stream.name} reads a {tuple(t.shape)} tensor that "
                    f"stream {producer.name} wrote (its kernel {n}) without waiting for it "
                    f"(it waited for {stream.waited.get(producer.name, 0)}): wait_stream, or "
                    f"wait for an event recorded after the write"
                )
        out = func(*args, **(kwargs or {}))
        stream.issued += 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._written(t, stream)
        return out
