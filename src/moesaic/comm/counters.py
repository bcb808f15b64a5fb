"""Event counters with thresholds: the signal side of the taskflow runtime's one-sided puts.

FlashDMoE (paper 003, §4-5) tells the receiver of a tile with a per-tile signal, and its
Subscriber turns arrived signals into tasks, so a GEMM tile starts as soon as *its* rows are
there; HyperParallel-MoE (paper 000, §4.4-4.5) synchronises tile tasks with event counters and
thresholds. :class:`EventCounters` is that synchronisation on one rank: per-event counters that
only go up, bumped by the tasks of this rank (``taskflow.runtime.executors``) and by the puts of
other ranks once their data is in place (``comm.channel.PutChannel``'s receiving thread);
``wait(event, threshold, timeout_s)`` returns once the count reaches the threshold, or raises
:class:`~moesaic.comm.collectives.CollectiveError` naming the event, the threshold and the count
reached. Listeners (``add_listener``) hear every bump: the dynamic executor's Scheduler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from moesaic.checks import check_int, check_positive, check_positive_int
from moesaic.comm.collectives import CollectiveError

__all__ = ["EventCounters"]


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
