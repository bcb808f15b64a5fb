"""FlowMoE's gradient chunks on a simulated step (``schedule/pool.py``'s rules): the flat
gradient buffer cut into Sp-byte chunks in the order the gradients complete, the gaps the
schedule's all-to-all waits open, each chunk's place (a gap's, or the tail after the last
wait), and the tail's chunks as one call (``schedule/grad_layout.py``). Priced and put on
the step's lanes by :func:`moesaic.sim.pipelined.run_pipelined`.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

from moesaic.sim.graph import SimGraph, SimTask
from moesaic.taskflow.engine import Timeline

__all__ = ["WaitPoint", "cut_chunks", "one_tail_chunk", "place_chunks", "wait_points"]

Chunk = tuple[float, str]  # (bytes, the key of the task its last gradient waits for)


def cut_chunks(
    block_bytes: float, outer_bytes: float, done: list[SimTask], chunk_bytes: float
) -> list[Chunk]:
    """The gradient buffer cut into chunks: each one's bytes and the task its last byte waits
    for. ``done[b]`` is block ``b + 1``'s last backward task; each block holds
    ``block_bytes`` of gradients, block 1 also the ``outer_bytes`` (embeddings, head)."""
    L = len(done)
    # Flat layout in completion order: block L, ..., block 1 (with the embeddings).
    ends, acc = [], 0.0
    for blk in range(L, 0, -1):
        acc += block_bytes + (outer_bytes if blk == 1 else 0.0)
        ends.append((acc, done[blk - 1].key))
    total = acc
    out, start = [], 0.0
    while start < total:
        stop = min(start + chunk_bytes, total)
        wait = next(key for end, key in ends if end >= stop - 1e-9)
        out.append((stop - start, wait))
        start = stop
    return out


class WaitPoint(NamedTuple):
    """A point where the schedule waits for an all-to-all: the compute task after it (its
    start is when the wait returns: the gap opens), the all-to-all and the compute task
    before it on the lane (None: the first); ``close``: when the next all-to-all in program
    order is issued (the gap closes), inf when none follows."""

    task: SimTask
    a2a_key: str
    before_key: str | None
    close: float

    def keys(self) -> tuple[str, ...]:
        """What the gap's opening waits for."""
        return (self.a2a_key,) if self.before_key is None else (self.before_key, self.a2a_key)


def wait_points(g: SimGraph, tl: Timeline, net_lane: str) -> list[WaitPoint]:
    """The schedule's all-to-all waits in program order (the compute lane's), from a
    timeline of the graph without chunks; the all-to-alls are on ``net_lane``."""
    a2a_keys = {t.key for t, _ in g.lanes[net_lane] if t.resource == "a2a"}
    compute = g.lanes["compute"]
    index = {t.key: i for i, (t, _) in enumerate(compute)}
    # an all-to-all is issued right after the compute task it waits for (program order);
    # the lane's tasks end in its order, so the first issued at or after a wait closes its gap
    issued = sorted(index[w] for t, w in g.lanes[net_lane] if t.resource == "a2a" and w in index)
    points = []
    for i, (task, wait) in enumerate(compute):
        if wait not in a2a_keys:
            continue
        j = bisect.bisect_left(issued, i)
        close = tl.end[compute[issued[j]][0].key] if j < len(issued) else math.inf
        points.append(WaitPoint(task, wait, compute[i - 1][0].key if i else None, close))
    return points


def place_chunks(
    chunks: list[Chunk], points: list[WaitPoint], tl: Timeline, in_gaps: bool
) -> list[tuple[WaitPoint | None, bool]]:
    """The runtime pool's rule (``schedule/pool.py``): after each all-to-all wait but the
    last (a gap, until the next all-to-all is issued) at most one chunk, if its gradients are
    ready by the gap's end (issued at the gap's opening or at its hook); after the last wait
    (the tail) every chunk left, as its gradients are ready. Returns per chunk the wait point
    whose gap (or tail) issues it (None: no all-to-all at all, as its gradients are ready)
    and whether it is a gap's."""
    tail = points[-1] if points else None
    gaps = points[:-1] if in_gaps else []
    out: list[tuple[WaitPoint | None, bool]] = []
    g = 0
    for _nbytes, wait in chunks:
        ready = tl.end[wait]
        while g < len(gaps) and ready > gaps[g].close:
            g += 1
        if g < len(gaps):
            out.append((gaps[g], True))
            g += 1
        else:
            out.append((tail, False))
    return out


def one_tail_chunk(
    chunks: list[Chunk], placed: list[tuple[WaitPoint | None, bool]]
) -> tuple[list[Chunk], list[tuple[WaitPoint | None, bool]]]:
    """The chunks placed in the tail (after the last gap) as one call of their bytes, ready
    with the last of them, as the pool cuts the gradients that complete in the tail
    (``schedule/grad_layout.py``: one chunk per bucket, not one per Sp)."""
    k = next((i for i, (_, in_gap) in enumerate(placed) if not in_gap), len(chunks))
    if len(chunks) - k < 2:
        return chunks, placed
    merged = (sum(nbytes for nbytes, _ in chunks[k:]), chunks[-1][1])
    return [*chunks[:k], merged], [*placed[:k], placed[-1]]
