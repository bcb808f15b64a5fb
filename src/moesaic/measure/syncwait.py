"""What a collective costs because the ranks do not reach it together, measured on an emulated
cluster (``calibrate --cluster``); priced by :mod:`moesaic.sim.syncwait` (its docstring says why
the wait exists and how it is priced).

**Measured** (:func:`measure`): every rank of the started cluster runs ``REPS`` rounds of
``[k square fp32 matmuls; one blocking all_to_all_single of b bytes]`` with no barrier between
rounds, ``k`` giving each compute segment ``T`` of ``SEGMENTS_S`` on the slowest rank (the ranks
agree on ``k``), at ``b`` a few bytes and a training step's message size. The call's mean
seconds beyond the same call's issued back to back (``T`` = 0) is the wait: ``wait(T, b) =
call(T, b) - call(0, b)``, means over the ranks and rounds. The rank whose segment ended first
waits for the last (their spread), and a call whose peers' transfers ran beside a late rank's
compute finishes later. Timed inside the rounds, not as a round's excess over compute measured
apart: on a shared machine the compute's own rate varies by more than the wait between two
passes (first tried: waits of -15 to +20 ms on the same cluster). Stored as
:class:`~moesaic.sim.profile.SyncWait` points, with the segments' mean compute.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from moesaic.sim.profile import SyncWait

__all__ = ["LOAD_MATMUL", "REPS", "SEGMENTS_S", "TINY_BYTES_PER_PAIR", "measure", "waits_from"]

# Compute segments between two calls, seconds on the slowest rank: a microbatch's stage (a few
# ms) to a block's backward (tens of ms).
SEGMENTS_S = (0.005, 0.015, 0.04, 0.1)
# Rounds per (segment, size), after one untimed call: the waits are a noisy mean (a round's excess
# varies by more than itself from round to round on a shared machine).
REPS = 30
# Side of the square fp32 matmuls a segment is made of (~1 ms on a core).
LOAD_MATMUL = 384
# The few bytes each rank sends each rank in the small call.
TINY_BYTES_PER_PAIR = 16


def _worker(
    rank: int, world: int, segments: list[float], sizes: list[int], reps: int, timeout_s: float
) -> dict[str, float]:
    """This rank's means over ``reps`` rounds of a compute segment ``T`` (0: none, calls back to
    back) then a blocking all-to-all of ``b`` bytes: ``"c:T:b"`` the segment's seconds,
    ``"d:T:b"`` the call's; ``"matmul"`` the agreed seconds per matmul."""
    import torch
    import torch.distributed as dist

    from moesaic.comm.collectives import EPGroup

    group = EPGroup(None, timeout_s)
    a = torch.randn(LOAD_MATMUL, LOAD_MATMUL)
    for _ in range(5):
        torch.mm(a, a)
    t0 = time.perf_counter()
    for _ in range(20):
        torch.mm(a, a)
    per = torch.tensor([(time.perf_counter() - t0) / 20])
    group.all_reduce(per, dist.ReduceOp.MAX, what="calibrate sync wait matmul time")
    matmul = float(per)
    out = {"matmul": matmul}
    for b in sizes:
        n = max(world, b // 4 // world * world)  # all_to_all_single splits evenly
        send, recv = torch.zeros(n), torch.empty(n)
        group.all_to_all_single(recv, send, what="calibrate sync wait warm-up")
        for seg in (0.0, *segments):
            k = round(seg / matmul)
            group.barrier("calibrate barrier")
            compute = call = 0.0
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(k):
                    torch.mm(a, a)
                t1 = time.perf_counter()
                group.all_to_all_single(recv, send, what="calibrate sync wait all_to_all")
                compute, call = compute + t1 - t0, call + time.perf_counter() - t1
            out[f"c:{seg}:{b}"], out[f"d:{seg}:{b}"] = compute / reps, call / reps
    group.barrier("calibrate barrier")
    return out


def measure(
    cluster: Any = None,
    nbytes: float = 1 << 20,
    *,
    segments: Sequence[float] = SEGMENTS_S,
    reps: int = REPS,
    timeout_s: float = 300.0,
) -> tuple[SyncWait, ...]:
    """The wait per call at ``segments`` x (a few bytes, ``nbytes`` per rank) on every rank of
    a started emulated ``cluster``, or a loopback pair without one (module docstring)."""
    if reps < 1:
        raise ValueError(f"reps ({reps}) must be >= 1")
    if not segments or any(s <= 0 for s in segments):
        raise ValueError(f"segments ({list(segments)}) must be a non-empty list of seconds > 0")
    if nbytes <= 0:
        raise ValueError(f"nbytes ({nbytes}) must be > 0")
    segs = sorted(set(float(s) for s in segments))
    if cluster is None:
        from moesaic.comm.world import run_world

        world = 2
        run = run_world
    else:
        world = cluster.spec.world_size
        run = cluster.run
    sizes = sorted({TINY_BYTES_PER_PAIR * world, max(int(nbytes) // 4 * 4, 4 * world)})
    per_rank = run(_worker, world, segs, sizes, reps, timeout_s, timeout_s=timeout_s)
    return waits_from(per_rank, segs, sizes)


def waits_from(
    per_rank: Sequence[dict[str, float]], segments: Sequence[float], sizes: Sequence[int]
) -> tuple[SyncWait, ...]:
    """:class:`SyncWait` points from the ranks' rounds (``_worker``'s keys): a call's mean
    seconds after a segment beyond its mean back to back, at the segments' mean compute."""

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in per_rank)

    return tuple(
        SyncWait(
            compute_s=mean(f"c:{seg}:{b}"),
            bytes_per_rank=float(b),
            wait_s=mean(f"d:{seg}:{b}") - mean(f"d:0.0:{b}"),
        )
        for b in sizes
        for seg in segments
    )
