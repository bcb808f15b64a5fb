"""Epoch-numbered signals of the persistent kernel (FlashDMoE's sequence-numbered flags): which
counter set, at which epoch, each launch of one bucket and direction uses, so that back-to-back
launches (forward, backward, the next step) reuse their counters without zeroing them and
without a host sync.

The kernel (``kernels.persistent``) meets a wait at ``epoch * threshold``: every event is bumped
exactly its threshold times per launch and every event is waited on
(``taskflow.lower.check_world_tables``), so a set used ``e`` times holds ``e * threshold`` per
event once its launch ended, which is where the next launch on it starts counting.

**Two sets, used in turn** (launch n, from 1, uses set ``(n - 1) % 2`` at epoch
``(n + 1) // 2``), and, for real peers, two receive windows the same way. Ranks run the launches
of one bucket and direction in the same order, each on one stream, and every rank's launch
waits on bumps from every other rank's same launch (``check_world_tables``: no rank is deaf to
another). So when rank A starts launch n + 2, it finished n + 1, which needed rank B's launch
n + 1 to have started, so B finished launch n: every bump of launch n into B's counters has
landed (each one is waited on) and B is done with its launch-n window (the forward's saved
rows are copied out of it on B's stream before B's next launch). A's launch n + 2 may thus
reuse launch n's set and window. One set would not do: A's launch n + 1 may bump one of B's
counters while a third rank's launch-n bump to it is still on its way, and B's launch-n wait
would count A's bump in its place.

A launch that failed (``TaskError``) leaves its set between epochs: the signals are unusable
after it (the layer's step raises; a new runtime starts new signals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SETS", "EpochSignals"]

SETS = 2  # counter sets (and receive windows) used in turn: see the module docstring


@dataclass(slots=True)
class EpochSignals:
    """The counters of one bucket and direction: ``counters`` int32 ``[SETS, n]`` (``n``:
    events times the ranks of one launch), never zeroed after they were made; ``launches``
    counts the launches that used them."""

    counters: torch.Tensor
    launches: int = 0

    def __post_init__(self) -> None:
        c = self.counters
        if c.dtype != torch.int32 or c.dim() != 2 or c.shape[0] != SETS:
            raise ValueError(
                f"counters must be an int32 [{SETS}, n] tensor, got {c.dtype} {tuple(c.shape)}"
            )

    @classmethod
    def zeros(cls, numel: int, device: torch.device | str = "cpu") -> EpochSignals:
        """Fresh signals of ``numel`` counters a set (at least one)."""
        return cls(torch.zeros(SETS, max(1, numel), dtype=torch.int32, device=device))

    def advance(self) -> tuple[int, int]:
        """``(set, epoch)`` of the next launch (and count it)."""
        self.launches += 1
        n = self.launches
        return (n - 1) % SETS, (n + SETS - 1) // SETS
