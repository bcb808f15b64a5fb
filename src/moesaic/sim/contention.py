"""CPU contention: a rank's compute slows down where its threads and its communication want more
CPU than its share of the machine's cores.

The emulated clusters run every rank on one machine (``calibrate --cluster`` records ``cores``
and ``ranks_per_machine``), and a rank's compute shares its ``c = cores / ranks_per_machine``
cores with its own communication: the collective thread (gloo), the kernel's network stack and
the emulated link's queue. The compute was measured on an otherwise idle machine with ``n``
torch threads (``OpCal.threads``; 1 without per-operation measurements). The model:

* a communication task of ``b`` bytes that lasts ``d`` seconds keeps ``L = min(1, comm_cpu_busy
  + (comm_cpu_s + b x comm_cpu_per_byte_s) / d)`` cores busy while it runs (its per-call and
  per-byte CPU spread evenly over it, and what a collective costs for as long as it is in
  flight, :mod:`moesaic.measure.cpuload`; at most one thread's worth);
* at a moment when the rank's communication keeps ``L`` cores busy (the sum over the tasks in
  flight), its ``n`` compute threads get a fair share of the machine's ``C = c m`` cores
  (``m`` ranks per machine) with what the other ranks want then, ``O``, and take ``s(L) =
  max(1, (n + L + O) / C)`` times as long as on cores of their own;
* the other ranks want ``O = (m - 1) (u n + Lbar)``: each computes a fraction ``u`` of the
  step and its communication keeps ``Lbar`` cores busy on average, both read off this rank's
  timeline (the representative rank's), as if the ranks' phases were independent. Until
  2026-11-26 every other rank was taken to compute whenever this one did (``O = (m - 1)(n +
  L)``, i.e. ``s = max(1, (n + L) / c)``); traced on a 4-rank step sharing 2 cores (z++--+,
  padded, moe-only and flowmoe), while rank 0 computed 1.7 and 1.6 of the other 3 ranks did
  on average, where their compute fractions (0.58, 0.52) give 1.74 and 1.56, and attention
  measured 1.0-1.3x its one-process time where the old rule charged 2x;
* the step's tail runs on every rank at once: each rank leaves the step's control all-reduce
  (:mod:`moesaic.sim.steptail`) together and takes its optimizer step then, so the
  optimizer (:data:`LOCKSTEP_RESOURCES`) is slowed as if every other rank computed beside it:
  ``O`` above with ``u = 1``, ``(m - 1)(n + Lbar)``. Traced, the 2 ranks of t+++-- started
  their optimizer within 1-4 ms of each other and the 4 of t+-+++ within 3-21 ms (each step
  13-42 ms long). On the stored points of the seventh to twelfth unseen rules (480) this took
  the error from 12.4% to 12.1% with the same 36 of 48 configurations ranked right (the arm
  fixed before the check; without ``Lbar``, tried after it, 12.3%; ``docs/simulator.md``);
* relative to what the compute times hold: the per-operation measurements (``ops``) were taken
  in one process on an otherwise idle machine, so compute advances at ``1 / s(L)`` of them;
  a FLOP rate measured some other way (a benchmark's compute-only step, as the validation's)
  is taken to have been measured with the run's ranks sharing the cores already, so compute
  advances at ``s(0) / s(L)`` of it (only the communication's CPU slows it further);
* the timeline is a fixed point: simulate, stretch every compute task (``COMPUTE_RESOURCES``:
  stages, optimizer) by integrating that rate from its start over the communication in flight,
  simulate again with the stretched durations; :data:`ITERATIONS` rounds (each from the
  measured durations, against the previous round's communication and ``u``, ``Lbar``).

Communication is priced between the profile's two regimes by the compute beside it. The
loaded collective shares were measured while every rank of the machine computed (a matmul
thread per rank), the idle ones with nothing computing. Given each communication task's seconds
at both (``idle``: ``simulate`` builds the graph once more on the idle shares), a task is priced
``idle + lam (loaded - idle)`` where ``lam = (f + (m - 1) u) / m``
(:meth:`CpuModel.collective_load`): ``f`` the share of its span during which this rank computes,
``u`` the other ranks' compute fraction, their phases independent of this rank's as above. A
vanilla step's collectives, with nothing of this rank computing beside them, are priced near
idle on one rank per machine and a quarter of the way to loaded on four ranks that compute a
third of the step. Priced loaded everywhere (until 2026-11-26), ``padded``'s exposed
exchanges on slow 4-rank links were over-priced by 22-47% (the eighth unseen rule's miss). On
the 48 measured configurations of the third to eighth unseen rules (seen data) the
measured-fastest combination was ranked first or within 5% of the first in 35 of 48 with this
rule, against 30 of 48 priced loaded (error 9.4% against 8.9%); on the ninth rule, measured
after the change, in 6 of 8 against 4 of 8 (14.3% against 13.6%; ``docs/simulator.md``). The
FlowMoE pool's all-reduce chunks stay where the uncontended timeline placed them.

Where the profile measured them (``sync_waits``), each communication task also waits for the
ranks' desynchronisation: ``wait(T, b)`` beyond its price, ``T`` the compute this rank did since
the ranks last met, i.e. since the latest end of a communication task of any lane before it
starts (:mod:`moesaic.sim.syncwait`), read off each round's timeline like ``f``. Until
2026-11-27 ``T`` ran from the previous task of the same lane: FlowMoE's gradient chunks, on a
lane of their own, then waited for all the compute since the step began although the ranks met
at every all-to-all in between (23.8 ms of waits priced on n+--+-, 12.9 since; rules 7-13's
560 stored points: error 12.33% -> 12.28%, 43 of 56 configurations ranked right either way).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moesaic.checks import check_non_negative, check_positive, check_positive_int
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.profile import Profile, SyncWait
from moesaic.sim.syncwait import wait_s
from moesaic.taskflow.engine import Timeline
from moesaic.trace import COMM_RESOURCES, COMPUTE_RESOURCES

__all__ = ["ITERATIONS", "LOCKSTEP_RESOURCES", "CpuModel", "contend", "skewed_compute_factor"]

# Rounds of the fixed point; on the pipelined graphs tried the third round moved the step by
# < 0.5% of the second.
ITERATIONS = 3
# Compute every rank of the machine runs at the same time (the module docstring): the step's
# tail, after the collectives that end the step on every rank together.
LOCKSTEP_RESOURCES = ("optimizer",)


@dataclass(kw_only=True, slots=True, frozen=True)
class CpuModel:
    """A rank's CPU (see the module docstring).

    Attributes:
        cores_per_rank: ``c``, cores / ranks per machine.
        machine_ranks: ``m``, the ranks sharing the machine's ``c m`` cores.
        threads: ``n``, the compute threads the compute times were measured with.
        comm_cpu_s: CPU seconds per communication task.
        comm_cpu_per_byte_s: CPU seconds per byte a communication task sends.
        comm_cpu_busy: Cores a communication task keeps busy for as long as it runs, beyond
            the two above.
        measured_alone: the compute times were measured by one process on an idle machine
            (``ops``); False: with the ranks already sharing the cores (module docstring).
    """

    cores_per_rank: float
    machine_ranks: int = 1
    threads: int = 1
    comm_cpu_s: float = 0.0
    comm_cpu_per_byte_s: float = 0.0
    comm_cpu_busy: float = 0.0
    measured_alone: bool = True

    def __post_init__(self) -> None:
        check_positive("cores_per_rank", self.cores_per_rank)
        check_positive_int("machine_ranks", self.machine_ranks)
        check_positive_int("threads", self.threads)
        check_non_negative("comm_cpu_s", self.comm_cpu_s)
        check_non_negative("comm_cpu_per_byte_s", self.comm_cpu_per_byte_s)
        check_non_negative("comm_cpu_busy", self.comm_cpu_busy)

    @classmethod
    def of(cls, profile: Profile) -> CpuModel | None:
        """The profile's CPU: None when it models none (no ``cores`` and ``ranks_per_machine``,
        or neither communication CPU nor per-operation measurements: older profiles)."""
        cores = profile.cores_per_rank
        modelled = (
            profile.comm_cpu_s
            or profile.comm_cpu_per_byte_s
            or profile.comm_cpu_busy
            or profile.ops
        )
        if cores is None or not modelled:
            return None
        return cls(
            cores_per_rank=cores,
            machine_ranks=profile.ranks_per_machine,
            threads=profile.ops.threads if profile.ops is not None else 1,
            comm_cpu_s=profile.comm_cpu_s,
            comm_cpu_per_byte_s=profile.comm_cpu_per_byte_s,
            comm_cpu_busy=profile.comm_cpu_busy,
            measured_alone=profile.ops is not None,
        )

    def load(self, task: SimTask, seconds: float) -> float:
        """Cores a communication task keeps busy while it runs for ``seconds``."""
        if seconds <= 0:
            return 0.0
        per_task = self.comm_cpu_s + task.nbytes * self.comm_cpu_per_byte_s
        return min(1.0, self.comm_cpu_busy + per_task / seconds)

    def slowdown(self, load: float, others: float | None = None) -> float:
        """How much longer compute takes than its measured time while this rank's
        communication keeps ``load`` cores busy and the machine's other ranks want ``others``
        cores (None: each as much as this rank, ``(m - 1)(n + load)``). A rate measured with
        the ranks already sharing the cores (``measured_alone`` False) held whatever overlap
        they had then: relative to it only this rank's communication slows, ``others`` is not
        used."""
        if others is None or not self.measured_alone:
            others = (self.machine_ranks - 1) * (self.threads + load)
        cores = self.cores_per_rank * self.machine_ranks
        shared = max(1.0, (self.threads + load + others) / cores)
        if self.measured_alone:
            return shared
        return shared / max(1.0, self.threads / self.cores_per_rank)

    def collective_load(self, own: float, compute_fraction: float) -> float:
        """``lam``: how far a collective's price moves from its idle toward its loaded share,
        this rank computing during ``own`` of its span and the machine's other ranks each
        computing ``compute_fraction`` of the time (module docstring); 0 to 1."""
        f = min(max(own, 0.0), 1.0)
        u = min(max(compute_fraction, 0.0), 1.0)
        return (f + (self.machine_ranks - 1) * u) / self.machine_ranks

    def others(self, compute_fraction: float, comm_load: float) -> float:
        """``O``: the cores the other ranks of the machine want, each computing
        ``compute_fraction`` of the time with ``threads`` threads and keeping ``comm_load``
        cores busy communicating on average."""
        u = min(max(compute_fraction, 0.0), 1.0)
        return (self.machine_ranks - 1) * (u * self.threads + max(comm_load, 0.0))


def skewed_compute_factor(shares: Sequence[float], cpu: CpuModel) -> float:
    """How much of its contended time the busiest rank's expert compute takes when the ranks'
    loads differ (``shares``: each rank's share of the rows; every rank of the machine).

    :func:`contend` slows a rank's compute as if every rank of the machine computed beside it,
    which holds for what all ranks do alike. Rows are not alike under skewed routing: once the
    lighter ranks are done they wait at the next all-to-all and leave their cores to the busier
    ones. With the ranks' loads in order ``l_1 >= ... >= l_P`` and all starting together, the
    busiest finishes after ``sum_k (l_k - l_{k+1}) max(1, k n / C)`` (``k`` ranks still
    computing on ``C`` cores with ``n`` threads each: processor sharing), where ``contend``
    charges ``l_1 max(1, P n / C)``; the factor is their ratio, 1 under uniform routing or
    where every rank has cores of its own."""
    P = len(shares)
    if P < 2 or max(shares) <= 0:
        return 1.0
    cores = cpu.cores_per_rank * P
    loads = [*sorted(shares, reverse=True), 0.0]
    shared = sum(
        (loads[k - 1] - loads[k]) * max(1.0, k * cpu.threads / cores) for k in range(1, P + 1)
    )
    return shared / (loads[0] * max(1.0, P * cpu.threads / cores))


class _Load:
    """The communication's CPU load over time: a step function from the comm tasks' spans."""

    def __init__(self, intervals: list[tuple[float, float, float]]):
        deltas: dict[float, float] = {}
        for start, end, load in intervals:
            if end > start and load > 0:
                deltas[start] = deltas.get(start, 0.0) + load
                deltas[end] = deltas.get(end, 0.0) - load
        self.times = sorted(deltas)
        self.levels: list[float] = []
        level = 0.0
        for t in self.times:
            level += deltas[t]
            self.levels.append(max(level, 0.0))

    def finish(
        self, start: float, work: float, cpu: CpuModel, others: float | None = None
    ) -> float:
        """When ``work`` seconds of compute (at the measured rate) started at ``start`` end,
        the other ranks wanting ``others`` cores (:meth:`CpuModel.slowdown`)."""
        i = bisect.bisect_right(self.times, start) - 1
        t = start
        while True:
            level = self.levels[i] if i >= 0 else 0.0
            rate = 1.0 / cpu.slowdown(level, others)
            nxt = self.times[i + 1] if i + 1 < len(self.times) else float("inf")
            if t + work / rate <= nxt:
                return t + work / rate
            work -= (nxt - t) * rate
            t, i = nxt, i + 1


def contend(
    g: SimGraph,
    tl: Timeline,
    cpu: CpuModel,
    idle: Mapping[str, float] | None = None,
    waits: Sequence[SyncWait] = (),
) -> tuple[Timeline, dict[str, Any]]:
    """``g`` re-simulated with its compute slowed by ``cpu`` and, where ``idle`` gives a
    communication task's seconds at the idle regime's shares, that task priced between them and
    its seconds in ``g`` (the loaded regime's) by the compute beside it (module docstring);
    ``g``'s lanes take the new durations. Returns the timeline and ``{"threads",
    "cores_per_rank", "other_ranks_cores", "compute_added_ms"}`` (compute seconds the contention
    added), with ``idle`` also ``"collective_load"`` (``lam`` averaged over the repriced tasks'
    loaded seconds) and ``"comm_saved_ms"`` (what pricing them so took off their loaded sum).
    With ``waits`` (the profile's ``sync_waits``) every communication task also waits for the
    ranks' desynchronisation after the compute since the ranks last met
    (:mod:`moesaic.sim.syncwait`; ``"sync_wait_ms"``, their sum)."""
    base = {t.key: t.seconds for t in g.tasks()}
    repriced = {
        t.key: idle[t.key]
        for t in g.tasks()
        if idle is not None and t.resource in COMM_RESOURCES and t.key in idle
    }
    lanes = g.lanes
    others = 0.0
    lam: dict[str, float] = {}
    wait: dict[str, float] = {}
    for _ in range(ITERATIONS):
        comm = [
            (tl.start[t.key], tl.end[t.key], cpu.load(t, tl.end[t.key] - tl.start[t.key]))
            for t in g.tasks()
            if t.resource in COMM_RESOURCES and t.key in tl.end
        ]
        load = _Load(comm)
        fraction = _compute_fraction(g, tl)
        comm_load = _comm_load(comm, tl.makespan)
        others = cpu.others(fraction, comm_load)
        together = cpu.others(1.0, comm_load)  # LOCKSTEP_RESOURCES: every other rank computes
        busy = _Busy(g, tl)
        lam = {
            key: cpu.collective_load(busy.share(tl.start[key], tl.end[key]), fraction)
            for key in repriced
            if key in tl.end
        }
        wait = _sync_waits(g, tl, busy, waits) if waits else {}
        lanes = {
            name: [
                (
                    _delayed(
                        _blend(
                            _stretched(t, base, tl, load, cpu, (others, together)),
                            base,
                            repriced,
                            lam,
                        ),
                        wait,
                    ),
                    w,
                )
                for t, w in jobs
            ]
            for name, jobs in g.lanes.items()
        }
        tl = g.run(lanes)
    g.lanes = lanes
    tasks = {t.key: t.seconds for t in g.tasks()}
    added = sum(tasks[k] - base[k] for k in tasks if k not in lam and k not in wait)
    info: dict[str, Any] = {
        "threads": cpu.threads,
        "cores_per_rank": cpu.cores_per_rank,
        "other_ranks_cores": others,
        "compute_added_ms": max(added, 0.0) * 1e3,  # >= 0 but for rounding
    }
    if lam:
        weight = math.fsum(base[k] for k in lam)
        info["collective_load"] = (
            math.fsum(lam[k] * base[k] for k in lam) / weight if weight > 0 else 0.0
        )
        info["comm_saved_ms"] = math.fsum(base[k] - tasks[k] + wait.get(k, 0.0) for k in lam) * 1e3
    if waits:
        info["sync_wait_ms"] = math.fsum(wait.values()) * 1e3
    return tl, info


class _Busy:
    """The spans during which a timeline's rank computes (its compute tasks' union)."""

    def __init__(self, g: SimGraph, tl: Timeline):
        spans = sorted(
            (tl.start[t.key], tl.end[t.key])
            for t in g.tasks()
            if t.resource in COMPUTE_RESOURCES and t.key in tl.end
        )
        merged: list[list[float]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            elif end > start:
                merged.append([start, end])
        self.starts = [s for s, _ in merged]
        self.ends = [e for _, e in merged]
        self.before = [0.0]  # busy seconds before each merged span
        for s, e in merged:
            self.before.append(self.before[-1] + e - s)

    def _upto(self, t: float) -> float:
        """Busy seconds before ``t``."""
        i = bisect.bisect_right(self.starts, t)
        if i == 0:
            return 0.0
        return self.before[i - 1] + min(t, self.ends[i - 1]) - self.starts[i - 1]

    def seconds(self, start: float, end: float) -> float:
        """Busy seconds within ``[start, end]``."""
        return max(self._upto(end) - self._upto(start), 0.0)

    def share(self, start: float, end: float) -> float:
        """The share of ``[start, end]`` during which the rank computes (0 for an empty span)."""
        if end <= start:
            return 0.0
        return (self._upto(end) - self._upto(start)) / (end - start)


def _compute_fraction(g: SimGraph, tl: Timeline) -> float:
    """The share of the step this rank's compute tasks take (their summed spans)."""
    span = tl.makespan
    if span <= 0:
        return 0.0
    compute = sum(
        tl.end[t.key] - tl.start[t.key]
        for t in g.tasks()
        if t.resource in COMPUTE_RESOURCES and t.key in tl.end
    )
    return compute / span


def _comm_load(comm: list[tuple[float, float, float]], span: float) -> float:
    """The communication's mean CPU load over ``span``."""
    if span <= 0:
        return 0.0
    return sum((end - start) * level for start, end, level in comm) / span


def _blend(
    t: SimTask, loaded: dict[str, float], idle: dict[str, float], lam: dict[str, float]
) -> SimTask:
    """``t`` priced ``lam`` of the way from its idle to its loaded seconds, where it has a
    ``lam``."""
    if t.key not in lam:
        return t
    low, high = idle[t.key], loaded[t.key]
    return t._replace(seconds=low + lam[t.key] * (high - low))


def _sync_waits(
    g: SimGraph, tl: Timeline, busy: _Busy, waits: Sequence[SyncWait]
) -> dict[str, float]:
    """Each communication task's wait for the ranks' desynchronisation: after the compute its
    rank did since the ranks last met, the latest end of a communication task of any lane at
    or before its start (the step's start for none)."""
    comm = [t for t in g.tasks() if t.resource in COMM_RESOURCES and t.key in tl.start]
    ends = sorted(tl.end[t.key] for t in comm)
    out: dict[str, float] = {}
    for t in comm:
        start = tl.start[t.key]
        i = bisect.bisect_right(ends, start)
        met = ends[i - 1] if i else 0.0
        out[t.key] = wait_s(waits, busy.seconds(met, start), t.nbytes)
    return out


def _delayed(t: SimTask, wait: dict[str, float]) -> SimTask:
    """``t`` with its wait added, where it has one."""
    extra = wait.get(t.key, 0.0)
    return t._replace(seconds=t.seconds + extra) if extra else t


def _stretched(
    t: SimTask,
    base: dict[str, float],
    tl: Timeline,
    load: _Load,
    cpu: CpuModel,
    others: tuple[float, float],
) -> SimTask:
    """``t`` slowed by the communication in flight and the cores the other ranks want:
    ``others`` is (each computing its fraction of the step, all computing), the latter for
    :data:`LOCKSTEP_RESOURCES`."""
    if t.resource not in COMPUTE_RESOURCES or t.key not in tl.start:
        return t
    start = tl.start[t.key]
    wanted = others[1] if t.resource in LOCKSTEP_RESOURCES else others[0]
    return t._replace(seconds=load.finish(start, base[t.key], cpu, wanted) - start)
