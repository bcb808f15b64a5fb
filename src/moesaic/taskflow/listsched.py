"""Pipelined queue orders: a list scheduler over a whole world's queues with nominal costs.

The compiled two-queue order is "kernel by kernel" inside each queue (all GMM1 tiles, then all
GMM2 tiles), so a forward's combine puts can only start once every GMM1 tile has run, and the
returned rows arrive in a burst at the end. ``pipeline_world`` re-orders the queues of every
rank offline (the order is still compiled into the plans, as HyperParallel-MoE's SSC wants;
nothing is decided at run time) by simulating all ranks' queues together with the nominal costs
the drawing uses (``draw.nominal_cost``; a put bumps its target rank's counters, as in the
cross-rank check) and letting each queue, whenever it is free, take among its tasks whose
dependent event is complete the one with the highest priority:

1. puts first (dispatch and combine tiles leave as soon as they can: the peers wait for them),
2. then the task of the latest operator in topological order (depth first: a GMM2 tile whose
   activation is done goes before the next GMM1 tile, so its combine put leaves early),
3. ties: the task's position in the given order (which keeps RATR's destination rotation and
   the backward's expert interleaving among equals).

Why the whole world: a rank alone cannot know when other ranks' writes land, and assuming
"at once" puts a reduce tile (which waits on every returned tile) ahead of the activation tiles
that feed this rank's own combine puts, which deadlocks two ranks doing the same (seen). Orders
taken from one simulated execution of the world cannot deadlock: in any real run, the blocked
head that comes first in the simulation waits only on tasks that came before it there, which
are done or at the head of a queue that is not blocked.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence

from moesaic.taskflow.draw import nominal_cost
from moesaic.taskflow.moe_graphs import TASK_TYPES
from moesaic.taskflow.plan import Plan
from moesaic.taskflow.tasks import CompileError, TaskDescriptor

__all__ = ["pipeline_world"]


def pipeline_world(plans: Sequence[Plan]) -> list[dict[str, list[int]]]:
    """Every rank's queues re-ordered by the list scheduler (see the module docstring).

    Args:
        plans: the plans of ranks ``0 .. P-1`` (any schedule: its order breaks ties).

    Raises:
        CompileError: no queue can take a task (the graphs cannot run together).
    """
    op_rank: dict[str, int] = {}
    for t in plans[0].tasks:  # tasks are generated operator by operator, in topological order
        op_rank.setdefault(t.op, len(op_rank))
    Key = tuple[int, str]
    thresholds = {(p.rank, ev.id): ev.threshold for p in plans for ev in p.events}
    tile_m = plans[0].bucket.tile_m

    def priority(t: TaskDescriptor, pos: int) -> tuple[int, int, int]:
        return (-int(TASK_TYPES[t.task_type].put), -op_rank[t.op], pos)

    count: dict[tuple[int, int], int] = defaultdict(int)
    ends: dict[tuple[int, int], float] = defaultdict(float)
    waiting: dict[tuple[int, int], list[tuple[Key, int, int]]] = defaultdict(list)
    timed: dict[Key, list[tuple[float, tuple[int, int, int], int]]] = {}
    avail: dict[Key, list[tuple[tuple[int, int, int], int]]] = {}
    free: dict[Key, float] = {}
    left: dict[Key, int] = {}
    out: dict[Key, list[int]] = {}

    def release(q: Key, uid: int, pos: int, at: float) -> None:
        heapq.heappush(timed[q], (at, priority(plans[q[0]].tasks[uid], pos), uid))

    def bump(ev: tuple[int, int], at: float) -> None:
        count[ev] += 1
        ends[ev] = max(ends[ev], at)
        if count[ev] == thresholds[ev]:
            for q, uid, pos in waiting.pop(ev, ()):
                release(q, uid, pos, ends[ev])

    for p in plans:
        for name, uids in p.schedule.queues:
            q = (p.rank, name)
            timed[q], avail[q], free[q], left[q], out[q] = [], [], 0.0, len(uids), []
            for pos, uid in enumerate(uids):
                ev = p.tasks[uid].dependent_event
                if ev < 0:
                    release(q, uid, pos, 0.0)
                else:
                    waiting[(p.rank, ev)].append((q, uid, pos))
    while any(left.values()):
        progressed = False
        for q in sorted((q for q in left if left[q]), key=lambda q: (free[q], q)):
            now = free[q]
            while timed[q] and timed[q][0][0] <= now:
                _, prio, uid = heapq.heappop(timed[q])
                heapq.heappush(avail[q], (prio, uid))
            if not avail[q]:
                continue
            _, uid = heapq.heappop(avail[q])
            t = plans[q[0]].tasks[uid]
            end = now + nominal_cost(t, tile_m)
            free[q], left[q] = end, left[q] - 1
            out[q].append(uid)
            for ref in t.trigger_events:
                bump((ref.rank, ref.event), end)
            progressed = True
            break
        if progressed:
            continue
        # Nobody can start now: move the idle queue whose next task is ready soonest.
        nexts = {q: timed[q][0][0] for q in left if left[q] and timed[q]}
        if not nexts:
            stuck = [q for q in left if left[q]]
            raise CompileError(f"pipeline order: queues {stuck} cannot go on (no task ready)")
        q = min(nexts, key=lambda q: (nexts[q], q))
        free[q] = max(free[q], nexts[q])
    return [{name: out[(p.rank, name)] for name, _ in p.schedule.queues} for p in plans]
