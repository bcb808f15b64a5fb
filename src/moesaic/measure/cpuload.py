"""Measure the CPU a rank's communication takes from its compute on an emulated cluster
(``moesaic calibrate --cluster``: the profile's ``comm_cpu_busy``; the model that uses it is
:mod:`moesaic.sim.contention`).

Every rank, with one torch thread as training runs its ranks, times a GEMM loop (``256 x 256 @
256 x 1024``, fp32) for ``seconds`` with the other ranks doing the same ("alone": the machine
shared by the ranks, no communication), then while a Python thread of the same rank issues
``all_to_all_single`` calls of ``nbytes`` per rank back to back, as the pipelined schedules'
communication thread does, as many as last ``seconds`` (agreed by every rank). The compute
slows down by ``s`` = alone / loaded rate. Under the contention model's fair share (``n``
compute threads, ``c`` cores per rank, communication keeping ``L`` cores busy: ``s =
max(1, (n + L) / c) / max(1, n / c)``), the communication kept ``L = max(0, s x max(c, n) - n)``
cores busy. What the profile's per-call and per-byte CPU (the puts') explain of it is
subtracted; the rest, ``comm_cpu_busy``, is CPU a rank spends for as long as a collective is in
flight, whatever its bytes (measured on issue 24's 120 Mbit/s pair: 0.27 cores against 0.016
from the puts' CPU per byte; ``benchmarks/sim_opcal_contention.py``).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from moesaic.checks import check_non_negative, check_positive, check_positive_int

__all__ = ["REPEATS", "CommCpu", "comm_cores", "measure_comm_cpu", "slowdown_worker"]

# Shape of the GEMM each rank's compute loop runs (~1 ms on one core here).
LOOP_GEMM = (256, 256, 1024)

# Measurements per round, the median kept. Single measurements (1 s or 4 s) of rule 10's
# clusters put the communication's cores anywhere in 0.02-1.02 (4 ranks) and 0.25-2.07
# (2 ranks) within a few minutes on the cluster kept up; 4 s did not narrow 1 s's spread; the
# medians of 8 stayed within 0.27-0.34 and 0.94-1.07 over four series
# (benchmarks/results/sim_comm_cpu_spread.json).
REPEATS = 7


@dataclass(kw_only=True, slots=True, frozen=True)
class CommCpu:
    """What :func:`measure_comm_cpu` found (the median over ranks).

    Attributes:
        slowdown: Alone / loaded compute rate.
        cores: ``L``, the cores the communication kept busy.
        bytes_per_s: Bytes a rank sent per second during the stream.
        calls_per_s: Collective calls per second during the stream.
        busy: ``cores`` less what the per-call and per-byte CPU explain (>= 0): the profile's
            ``comm_cpu_busy``.
    """

    slowdown: float
    cores: float
    bytes_per_s: float
    calls_per_s: float
    busy: float


def comm_cores(slowdown: float, threads: int, cores_per_rank: float) -> float:
    """``L`` from a measured slowdown (module docstring's inversion of the fair share); 0 when
    nothing slowed down (then ``L <= cores_per_rank - threads``: the cores had room for it)."""
    check_positive("slowdown", slowdown)
    check_positive_int("threads", threads)
    check_positive("cores_per_rank", cores_per_rank)
    if slowdown <= 1.0:
        return 0.0
    return max(0.0, slowdown * max(cores_per_rank, threads) - threads)


def slowdown_worker(
    rank: int, world: int, seconds: float, nbytes: int, timeout_s: float
) -> dict[str, float]:
    """One rank of the measurement (module docstring): its slowdown, bytes and calls per s."""
    import torch

    from moesaic.comm.collectives import EPGroup

    torch.set_num_threads(1)
    group = EPGroup(None, timeout_s)
    m, k, n = LOOP_GEMM
    a, w = torch.randn(m, k), torch.randn(k, n)
    send = torch.zeros(max(world, nbytes // 4 // world * world))
    recv = torch.empty_like(send)
    group.barrier("cpuload barrier")
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, w)
        done += 1
    alone = done / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(3):
        group.all_to_all_single(recv, send, what="cpuload probe")
    per_s = torch.tensor([3 / (time.perf_counter() - t0)])
    group.all_reduce(per_s, what="cpuload calls")  # summed: / world gives the mean
    calls = max(3, int(seconds * per_s.item() / world))

    def stream() -> None:
        for _ in range(calls):
            group.all_to_all_single(recv, send, what="cpuload all_to_all")

    thread = threading.Thread(target=stream, daemon=True)
    group.barrier("cpuload barrier")
    done, t0 = 0, time.perf_counter()
    thread.start()
    while thread.is_alive():
        torch.mm(a, w)
        done += 1
    elapsed = time.perf_counter() - t0
    thread.join()
    group.barrier("cpuload barrier")
    sent = calls * send.numel() * 4 * (world - 1) / world  # to the other ranks
    return {
        "slowdown": alone / (done / elapsed),
        "bytes_per_s": sent / elapsed,
        "calls_per_s": calls / elapsed,
    }


def measure_comm_cpu(
    cluster: Any,
    *,
    cores_per_rank: float,
    comm_cpu_s: float = 0.0,
    comm_cpu_per_byte_s: float = 0.0,
    seconds: float = 1.0,
    nbytes: int = 512 * 1024,
    rounds: int = 1,
    repeats: int = REPEATS,
    timeout_s: float = 120.0,
) -> CommCpu:
    """Measures a started ``cluster`` (module docstring): one thread per rank, ``seconds``
    alone and ``seconds`` streaming ``nbytes``-per-rank all-to-alls; ``repeats`` times in each
    of ``rounds``, each figure the median over all of them of its median over ranks."""
    check_positive("cores_per_rank", cores_per_rank)
    check_non_negative("comm_cpu_s", comm_cpu_s)
    check_non_negative("comm_cpu_per_byte_s", comm_cpu_per_byte_s)
    check_positive("seconds", seconds)
    check_positive_int("nbytes", nbytes)
    check_positive_int("rounds", rounds)
    check_positive_int("repeats", repeats)
    world = cluster.spec.world_size
    runs = [
        cluster.run(slowdown_worker, world, seconds, nbytes, timeout_s, timeout_s=timeout_s + 60)
        for _ in range(rounds * repeats)
    ]

    def median(key: str) -> float:
        return statistics.median(statistics.median(r[key] for r in ranks) for ranks in runs)

    slowdown = median("slowdown")
    bytes_per_s = median("bytes_per_s")
    calls_per_s = median("calls_per_s")
    cores = comm_cores(slowdown, 1, cores_per_rank)
    explained = comm_cpu_s * calls_per_s + comm_cpu_per_byte_s * bytes_per_s
    return CommCpu(
        slowdown=slowdown,
        cores=cores,
        bytes_per_s=bytes_per_s,
        calls_per_s=calls_per_s,
        busy=min(1.0, max(0.0, cores - explained)),
    )
