"""Device streams and events behind one small interface, with a CPU stand-in.

The code NCCL takes enqueues work on side streams, makes streams wait for each other and times
transfers with events. ``CudaStreams`` is that interface over ``torch.cuda``; ``HostStreams`` is
its stand-in on a CPU: a CPU runs every kernel when it is issued, so issuing *is* the order of
execution, and the stand-in keeps a log of what was issued on which stream and which waits were
asked for (``HostStreams.log``), so a test on CPU runs the same branch (``_run_on_stream`` of
the hybrid prefetcher, the pool's event-timed spans) and can check its order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

__all__ = ["CudaStreams", "HostEvent", "HostStream", "HostStreams", "Streams"]


class Streams(Protocol):
    """Where device work is enqueued: the current stream, side streams, events."""

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
        ``elapsed_time(end)`` in ms when ``timing``)."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor`` (allocated on another stream) is used on ``stream``: the caching
        allocator must not reuse its memory before ``stream`` is done with it."""
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


class HostStream:
    """A stand-in stream: waits are logged (the host already ran what they wait for)."""

    def __init__(self, owner: HostStreams, name: str) -> None:
        self.owner, self.name = owner, name

    def wait_stream(self, other: HostStream) -> None:
        self.owner.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: HostEvent) -> None:
        if event.stream is None:
            raise RuntimeError("a stream waited for an event that was never recorded")
        self.owner.log.append(("wait_event", self.name, event.stream))


class HostEvent:
    """A stand-in event: records the host time and the stream it was recorded on."""

    def __init__(self, owner: HostStreams, timing: bool) -> None:
        self.owner, self.timing = owner, timing
        self.stream: str | None = None
        self.time_s = 0.0

    def record(self, stream: HostStream | None = None) -> None:
        self.stream = (stream or self.owner.current()).name
        self.time_s = time.perf_counter()
        self.owner.log.append(("record", self.stream, id(self)))

    def wait(self, stream: HostStream | None = None) -> None:
        (stream or self.owner.current()).wait_event(self)

    def synchronize(self) -> None:
        if self.stream is None:
            raise RuntimeError("synchronize() on an event that was never recorded")

    def elapsed_time(self, end: HostEvent) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs events created with timing=True")
        return (end.time_s - self.time_s) * 1e3


class HostStreams:
    """:class:`Streams` on a CPU (see the module docstring): ``log`` lists, in issue order,
    ``("wait_stream", waiter, waited)``, ``("wait_event", waiter, recorded on)``,
    ``("record", stream, event id)`` and ``("record_stream", stream, shape)``."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self._main = HostStream(self, "main")
        self._stack: list[HostStream] = [self._main]
        self._made = 0

    def current(self) -> HostStream:
        return self._stack[-1]

    def new_stream(self) -> HostStream:
        self._made += 1
        return HostStream(self, f"side{self._made}")

    @contextmanager
    def use(self, stream: HostStream) -> Iterator[HostStream]:
        self._stack.append(stream)
        try:
            yield stream
        finally:
            self._stack.pop()

    def event(self, *, timing: bool = False) -> HostEvent:
        return HostEvent(self, timing)

    def record_stream(self, tensor: torch.Tensor, stream: HostStream) -> None:
        self.log.append(("record_stream", stream.name, tuple(tensor.shape)))
