"""What a collective costs because the ranks do not reach it together: measured on an emulated
cluster (``calibrate --cluster``) and priced per collective.

The simulator follows one representative rank and starts each collective when that rank
issues it, as if every peer issued it at the same moment. On a real machine they do not: the
ranks' compute between two collectives takes a little longer on one than on another
(scheduling, the kernel's network work on a shared core, a peer's communication threads), so
every call waits for the last rank. Traced on the ninth unseen rule's r+-++- (2 ranks sharing
2 cores, 2.2 Gbit/s), the second rank issued each FlowMoE all-to-all 13-16 ms (median) after
the first. The collective shares do not see it: they time calls issued back to back or after a
barrier.

**Priced** (:func:`wait_s`, applied by :func:`moesaic.sim.contention.contend`): a communication
task waits ``wait(T, b)`` beyond its price, ``T`` the compute its rank did since the ranks last
met (the latest end of a communication task of any lane before it starts, or the step's start),
``b`` its bytes. Between measured segments
linear in ``T`` from ``wait(0) = 0``, beyond the longest proportional to ``T``; between
measured sizes linear in log bytes, the nearest size outside them; never below 0 (a measured
negative excess is noise).
The points are measured by :mod:`moesaic.measure.syncwait`.
"""

from __future__ import annotations

from collections.abc import Sequence

from moesaic.sim.interp import log_linear
from moesaic.sim.profile import SyncWait

__all__ = ["wait_s"]


def wait_s(points: Sequence[SyncWait], compute_s: float, nbytes: float) -> float:
    """The wait of a call of ``nbytes`` issued after ``compute_s`` of compute (module
    docstring); 0 without points."""
    if not points or compute_s <= 0:
        return 0.0
    by_size: dict[float, list[SyncWait]] = {}
    for p in points:
        by_size.setdefault(p.bytes_per_rank, []).append(p)
    curve = [
        (b, _in_segments(sorted(ps, key=lambda p: p.compute_s), compute_s))
        for b, ps in sorted(by_size.items())
    ]
    return max(0.0, log_linear(curve, max(nbytes, 1.0), empty=0.0))


def _in_segments(points: list[SyncWait], t: float) -> float:
    """One size's wait after ``t`` seconds of compute: linear from (0, 0) through the measured
    segments, proportional beyond the longest."""
    x0, y0 = 0.0, 0.0
    for p in points:
        if t <= p.compute_s:
            w = (t - x0) / (p.compute_s - x0) if p.compute_s > x0 else 1.0
            return y0 + w * (p.wait_s - y0)
        x0, y0 = p.compute_s, p.wait_s
    return y0 * t / x0 if x0 > 0 else 0.0
