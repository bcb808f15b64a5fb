"""The bookkeeping of signals written into a peer's memory: where each lands, what value it
carries, and what a receiver makes of a snapshot. No device and no torch: the logic of
:class:`~moesaic.comm.symmetric.SymmetricMemoryChannel` that a CPU test can check alone.

Every rank owns one int32 **signal array** per receive window, one row per source rank:
``[epoch, puts, event 0, ..., event E-1]`` (:class:`SignalLayout`). Only source ``s`` writes
row ``s`` of any rank's array, and it writes **values, not increments**: the running total of
what it has signalled there (:class:`SignalLedger`), modulo 2**32 (the device writes 32-bit
words). A single writer per word that only ever writes a larger total needs no remote atomics:
an increment is "write my new total", and a receiver that missed one write sees the next total.
The receiver keeps the last total it saw per word (:class:`Arrivals`) and turns each snapshot
into event increments (``EventCounters.bump``) and a count of arrived puts.

* ``epoch``: the step this source has begun (the step fence: a rank puts step n rows only once
  every rank's epoch reached n, so the window's readers of step n-1 are done).
* ``puts``: puts this source made into this rank, all steps; written after the put's data and
  its event words, so a snapshot showing all expected puts is followed by one more snapshot
  that sees every event word too.
* ``event j``: signals of event ``j`` from this source, all steps.

Totals are never reset (a reset would race a peer that already began the next step): a step's
share is the difference to what was seen when the step began.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moesaic.checks import check_int, check_positive_int

__all__ = [
    "TRANSPORTS",
    "WORD",
    "Arrivals",
    "SignalLayout",
    "SignalLedger",
    "ahead_or_equal",
    "wrap_delta",
]

# How a taskflow step's tiles move (``comm.symmetric.pick_transport``): "auto": symmetric memory
# for CUDA tensors on more than one rank when it is available, else gloo; "gloo": always the
# gloo PutChannel (CPU tensors only); "symmetric": always symmetric memory (CUDA tensors and an
# initialised torch.distributed required), also on one rank. Here, torch-free, for the options.
TRANSPORTS = ("auto", "gloo", "symmetric")

WORD = 1 << 32  # signal words are 32-bit: totals wrap modulo WORD
_HALF = 1 << 31


def wrap_delta(new: int, old: int) -> int:
    """``new - old`` for 32-bit totals read as signed or unsigned ints (fewer than 2**31
    increments apart)."""
    return (new - old) % WORD


def ahead_or_equal(value: int, target: int) -> bool:
    """Whether 32-bit total ``value`` has reached ``target`` (modulo 2**32, within 2**31)."""
    return (value - target) % WORD < _HALF


@dataclass(frozen=True, slots=True)
class SignalLayout:
    """Word indices in one rank's signal array: ``ranks`` rows of ``2 + events`` words."""

    ranks: int
    events: int

    def __post_init__(self) -> None:
        check_positive_int("ranks", self.ranks)
        check_positive_int("events", self.events)

    @property
    def width(self) -> int:
        """Words per source row."""
        return 2 + self.events

    @property
    def numel(self) -> int:
        """Words of the whole array."""
        return self.ranks * self.width

    def epoch_index(self, src: int) -> int:
        """The word where ``src`` writes the step it has begun."""
        return check_int("src", src, 0, self.ranks - 1) * self.width

    def puts_index(self, src: int) -> int:
        """The word where ``src`` writes its running total of puts into this rank."""
        return self.epoch_index(src) + 1

    def event_index(self, src: int, event: int) -> int:
        """The word where ``src`` writes its running total of ``event`` signals."""
        return self.epoch_index(src) + 2 + check_int("event", event, 0, self.events - 1)


class SignalLedger:
    """A source rank's running totals per (destination rank, word): the values it writes.

    Not thread-safe: the channel holds its lock while it enqueues a put and its signal writes,
    so that the totals reach each word in increasing order (one stream, one writer)."""

    def __init__(self, ranks: int) -> None:
        self._totals: list[dict[int, int]] = [{} for _ in range(ranks)]

    def next(self, dst: int, index: int, by: int = 1) -> int:
        """Add ``by`` to ``dst``'s word ``index``; returns the new total modulo 2**32."""
        total = (self._totals[dst].get(index, 0) + by) % WORD
        self._totals[dst][index] = total
        return total

    def set(self, dst: int, index: int, value: int) -> int:
        """Set ``dst``'s word ``index`` to ``value`` (the epoch); returns it modulo 2**32."""
        self._totals[dst][index] = value % WORD
        return self._totals[dst][index]


class Arrivals:
    """What a receiver has seen in its own signal array, and what a step has received.

    Args:
        layout: the array's layout.
    """

    def __init__(self, layout: SignalLayout) -> None:
        self.layout = layout
        self._seen = [0] * layout.numel
        self._step_base = [0] * layout.ranks  # puts totals per source when the step began

    def begin_step(self) -> None:
        """A step begins: its puts are those seen from now on."""
        self._step_base = [self._seen[self.layout.puts_index(s)] for s in range(self.layout.ranks)]

    def absorb(self, snapshot: Sequence[int]) -> list[tuple[int, int]]:
        """Take a snapshot of the array; returns ``(event, increments)`` for every event word
        that moved since the last one (summed over sources), in event order."""
        if len(snapshot) != self.layout.numel:
            raise ValueError(f"snapshot has {len(snapshot)} words, the layout {self.layout.numel}")
        moved: dict[int, int] = {}
        L = self.layout
        for s in range(L.ranks):
            row = s * L.width
            for j in range(L.events):
                k = row + 2 + j
                delta = wrap_delta(snapshot[k], self._seen[k])
                if delta:
                    moved[j] = moved.get(j, 0) + delta
            for k in (row, row + 1):  # epoch and puts: kept, not signalled
                self._seen[k] = snapshot[k] % WORD
            for j in range(L.events):
                self._seen[row + 2 + j] = snapshot[row + 2 + j] % WORD
        return sorted(moved.items())

    def step_puts_P(self) -> list[int]:
        """Puts received this step from each source."""
        L = self.layout
        return [wrap_delta(self._seen[L.puts_index(s)], self._step_base[s]) for s in range(L.ranks)]

    def step_puts(self) -> int:
        """Puts received this step from every source together."""
        return sum(self.step_puts_P())

    def behind(self, step: int) -> list[int]:
        """The sources whose epoch has not reached ``step`` (modulo 2**32)."""
        L = self.layout
        return [s for s in range(L.ranks) if not ahead_or_equal(self._seen[L.epoch_index(s)], step)]
