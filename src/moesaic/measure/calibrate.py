"""Measures the links of an emulated cluster into a simulator profile (``calibrate --cluster``).

Two emulated clusters are brought up, one after the other, in network namespaces
(:class:`moesaic.cluster.netns.EmulatedCluster`, needs root, ``ip`` and ``tc``):

1. an unshaped pair (100 Gbit/s, 0 ms: far above what tbf, the delay line and gloo sustain):
   its measured one-way latency is ``floor_s``, the least a message costs on this machine, as
   ``benchmarks/cluster_check.py``'s ``unshaped`` entry (skipped with ``floor=False``);
2. the cluster of the TOML file: :func:`moesaic.cluster.verify.check` measures, per level that
   separates some ranks, one rank pair's point-to-point bandwidth (two transfer sizes
   differenced) and one-way latency (fastest ping-pong halved). Each becomes a
   :class:`~moesaic.sim.profile.LinkLevel`; ``bandwidth_scale`` is the median over the levels of
   measured / configured bandwidth;
3. the same cluster, still up: its all-to-all (``all_to_all_single``) and all-reduce timed at
   ``COLLECTIVE_SIZES`` x the check's collective size (:func:`collective_shares`), each turned
   into the bandwidth share under which the simulator's closed form, on the links of step 2
   and the floor of step 1, gives the measured time
   (:class:`~moesaic.sim.profile.CollectiveShare`), in two regimes: ``"idle"``, the mean of 8
   isolated calls (a barrier before each) on an otherwise idle machine, and ``"loaded"``, the
   time per call of the last 8 calls of an unbroken stream of the same call (``sustain_s`` of
   warm-up at the links' rate; their elapsed time over 8, slowest rank) while every rank also
   runs fp32 matmuls in a thread of its own, as a
   training step computes while its collectives are in flight. The difference is physical, not
   noise: on a shaped link whose ranks are starved of CPU, TCP falls into a mode where a 2-rank
   exchange runs at about half its idle rate and stays there while the stream lasts. Measured
   on hybridep_2dc, 0.5 MB per rank all-to-all streams of 25 calls: 25-26 ms every call on
   the idle machine (with or without a 1 ms gap between calls), 45 ms from the first or the
   fifth call on with two busy processes beside the ranks; 2 MB: 88-99 ms vs 168 ms. The
   validated runs ran on a loaded machine (load average 3-5 on 2 cores during the HybridEP
   runs, recorded in their results) with ranks that compute beside their collectives;
4. still on that cluster, the collectives' call floors (:func:`collective_calls`): a tiny
   all-to-all's mean time a call, issued back to back (:func:`back_to_back_a2a_s`), an
   all-reduce of a few bytes per call in a stream
   of ``CALL_STREAM`` calls issued back to back then waited (how FlowMoE's pool issues its
   gradient chunks in the tail), and one such all-reduce issued alone (a training step's one
   control collective: the norm, the health flags and the statistics), on the idle machine;
   measured before step 3, whose shares are relative to the closed forms with these floors;
   then one such all-reduce issued alone while every rank computes (how the pool issues a
   chunk beside the backward), in ``LOADED_CALL_BLOCKS`` blocks, each under a load started
   for it;
   On a cluster of more than one level, also each inner exchange (:func:`level_shares`): an
   all-to-all over every group of ranks that differ in one level's coordinate only, all at
   once, at the same sizes and in both regimes (HybridEP's gathers and exchanges inside a
   level);
5. still on that cluster, the CPU that the taskflow runtime's one-sided puts
   (``comm.channel.PutChannel``) cost between ranks 0 and 1 (:func:`put_cpu`): per put and per
   byte;
6. still on that cluster, what a blocking all-to-all waits because the ranks reach it after a
   stretch of compute rather than together (:mod:`moesaic.sim.syncwait`): compute segments and
   calls in turn with no barrier, against the same compute alone and the calls back to back,
   for a few bytes and the smallest size of step 3 (a training step's messages).

Everything else about the links (sizes, the configured rates the scale multiplies, latencies
above the floor) is the cluster file's. Torch is used by the workers only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from moesaic.checks import check_non_negative, check_positive, check_positive_int
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.measure import syncwait
from moesaic.sim.profile import CollectiveShare, LevelShare, LinkLevel, Profile, SyncWait

__all__ = [
    "ALONE_CALL_BYTES",
    "CALL_STREAM",
    "COLLECTIVE_SIZES",
    "UNSHAPED",
    "CallFloors",
    "LinkCalibration",
    "alone_all_reduce_s",
    "back_to_back_a2a_s",
    "closed_form_s",
    "collective_calls",
    "collective_share",
    "collective_shares",
    "level_groups",
    "level_shares",
    "matmul_load",
    "measure_links",
    "median_calls",
    "median_links",
    "share_probe",
    "warmup_calls",
]

# Sizes the collectives are timed at, as fractions of the check's collective size (what the
# slowest level moves in half a bandwidth transfer): the validated runs' messages span them.
COLLECTIVE_SIZES = (1 / 16, 1 / 4, 1.0)

# Times steps 2-4 of the module docstring are measured on a cluster, the median of each figure
# kept (``calibrate --rounds``). Two calibrations of one 4-rank cluster on 2 cores, a day apart,
# priced its steps 44% apart (loaded all-reduce shares 0.08 against 0.23, the busy communication
# CPU 0.05 against 0.60 cores) while the steps measured within 5%. Three rounds narrowed the
# spread of six calibrations' predictions (max / min per combination, median: 1.24 -> 1.15 and
# 1.32 -> 1.19 on two clusters) at 2.2x the calibration's time, and did not lower their error
# against the measured steps (7.9 -> 12.6% and 15.8 -> 14.0%): one stays the default
# (``docs/simulator.md``, "Calibrating twice").
ROUNDS = 1

# Calls timed per size and regime, and the fewest and most warm-up calls of a loaded stream.
COLLECTIVE_REPS = 8
MIN_WARMUP_CALLS = 3
MAX_WARMUP_CALLS = 400
# Side of the square matmuls each rank's load thread runs during the loaded stream (~1 ms).
LOAD_MATMUL = 384
# The call floors: all-reduces per timed stream, timed repetitions (after one warm-up) of the
# stream and of the alone all-reduce, and bytes each rank sends to each rank.
CALL_STREAM = 32
CALL_REPS = 6
CALL_BYTES_PER_PAIR = 16
# Tiny all-to-alls timed back to back, each waited, after one untimed (the all-to-all's floor).
A2A_CALLS = 20
# Bytes of the alone all-reduce: a training step's control collective (the norm, the health
# flags, each MoE layer's expert loads: a few hundred bytes), at least one element a rank up to
# 256 ranks. Not CALL_BYTES_PER_PAIR: gloo's ring skips the exchanges of empty chunks, so 4
# floats over 8 ranks took 13 ms alone on w32c's cluster where 32 or 256 took 40-42 ms.
ALONE_CALL_BYTES = 1024
# Blocks of the loaded all-reduce, each ``CALL_REPS`` calls (after one warm-up) under a load
# thread started for the block and stopped after it. Under one load thread left running, the
# calls' mean drifts over seconds: on m+---+'s cluster (4 ranks) six calls gave 13-118 ms
# between 18 rounds, 24 calls 11-137 ms, and four runs of 8 x 6 calls 72-145 ms. Under a fresh
# thread per block the same four runs gave 56-65 ms (their mean over 48 calls), as a training
# step computes for well under a second beside its gradient chunks, not for tens of seconds
# (``benchmarks/results/sim_loaded_call_blocks.json``).
LOADED_CALL_BLOCKS = 8

# The emulator's floor: a link shaped far above what this machine moves (cluster_check.py's).
UNSHAPED = ClusterSpec(
    levels=(Level(name="link", size=2, bandwidth_gbps=100.0, latency_ms=0.0),), name="unshaped"
)


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkCalibration:
    """What :func:`measure_links` measured.

    Attributes:
        links: One entry per separating level of the cluster.
        bandwidth_scale: Median measured / configured bandwidth over ``links``.
        floor_s: One-way latency of the unshaped pair, seconds (0 when not measured).
        collectives: The check's all-to-all and all-reduce medians and bounds (for the record).
        shares: The collectives timed at ``COLLECTIVE_SIZES``, as shares of the links.
        level_shares: Each inner exchange timed at those sizes (:func:`level_shares`).
        put_cpu_s: CPU seconds per one-sided put (sender and receiver; :func:`put_cpu`).
        put_cpu_per_byte_s: CPU seconds per byte put.
        a2a_call_s: A tiny all-to-all per call back to back (:func:`collective_calls`).
        allreduce_call_s: A tiny all-reduce per call in a stream (:func:`collective_calls`).
        allreduce_loaded_call_s: One tiny all-reduce alone while every rank computes.
        allreduce_alone_call_s: One tiny all-reduce alone on the idle machine.
        sync_waits: What a blocking all-to-all waits for the ranks' desynchronisation after a
            stretch of compute (:func:`moesaic.measure.syncwait.measure`).
    """

    links: tuple[LinkLevel, ...]
    bandwidth_scale: float
    floor_s: float
    collectives: dict[str, Any]
    shares: tuple[CollectiveShare, ...] = ()
    level_shares: tuple[LevelShare, ...] = ()
    put_cpu_s: float = 0.0
    put_cpu_per_byte_s: float = 0.0
    a2a_call_s: float = 0.0
    allreduce_call_s: float = 0.0
    allreduce_loaded_call_s: float = 0.0
    allreduce_alone_call_s: float = 0.0
    sync_waits: tuple[SyncWait, ...] = ()


def links_from_report(report: Any) -> tuple[LinkLevel, ...]:
    """:class:`LinkLevel` entries from a :class:`moesaic.cluster.verify.CheckReport`."""
    return tuple(
        LinkLevel(
            level_name=m.level_name,
            configured_bandwidth_gbps=m.configured_bandwidth_gbps,
            measured_bandwidth_gbps=m.measured_bandwidth_gbps,
            configured_latency_ms=m.configured_latency_ms,
            measured_latency_ms=m.measured_latency_ms,
        )
        for m in report.levels
    )


def median_links(rounds: list[tuple[LinkLevel, ...]]) -> tuple[LinkLevel, ...]:
    """Per level, the median of the measured bandwidth and latency over ``rounds`` (each a
    :func:`links_from_report` of the same cluster)."""
    if not rounds:
        raise ValueError("rounds must hold at least one measurement")
    return tuple(
        dataclasses.replace(
            levels[0],
            measured_bandwidth_gbps=statistics.median(x.measured_bandwidth_gbps for x in levels),
            measured_latency_ms=statistics.median(x.measured_latency_ms for x in levels),
        )
        for levels in zip(*rounds, strict=True)
    )


@contextlib.contextmanager
def matmul_load() -> Iterator[list[int]]:
    """Inside: a thread of this process runs ``LOAD_MATMUL`` fp32 matmuls back to back (the
    load calibrate times collectives under, as a training step computes beside them). Yields
    a one-item list that counts the matmuls done."""
    import threading

    import torch

    a = torch.randn(LOAD_MATMUL, LOAD_MATMUL)
    stop = threading.Event()
    done = [0]

    def compute() -> None:
        while not stop.is_set():
            torch.mm(a, a)
            done[0] += 1

    loader = threading.Thread(target=compute, daemon=True)
    loader.start()
    try:
        yield done
    finally:
        stop.set()
        loader.join()


def _worker_collectives(
    rank: int,
    world: int,
    sizes: list[int],
    reps: int,
    warmup: dict[str, int],
    timeout_s: float,
    groups: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Times ``all_to_all_single`` and ``all_reduce`` at every size: idle (a barrier before
    each call, after one warm-up; keys ``kind:nbytes``), then, when ``warmup`` has the key,
    loaded: in one unbroken stream (``warmup[key]`` untimed calls, then ``reps`` timed, no
    barrier in between, sizes ascending; keys ``loaded:kind:nbytes``: one value, the timed
    calls' elapsed time over ``reps``) while a thread of this rank runs ``LOAD_MATMUL`` fp32
    matmuls; ``"load_flops_per_s"``: that thread's rate. With ``groups`` (rank lists that
    partition the world, the same on every rank) the calls run over this rank's group, every
    group at once (the barriers stay the world's), all-to-alls only.

    The calls go through ``EPGroup`` (the choke point: issued async, waited under
    ``timeout_s``), as a training step issues them; its traffic count and order log add about
    2 us per call (measured: 1.9 us), under the loopback's own 0.17-1.3 ms per call and the
    emulated links' 0.15 ms floor."""

    import torch

    from moesaic.comm.collectives import EPGroup

    world_group = group = EPGroup(None, timeout_s)
    kinds: tuple[str, ...] = ("all_to_all", "all_reduce")
    if groups is not None:
        from moesaic.comm.groups import registry

        registry().create(groups, "main", timeout_s)  # every rank, every group
        mine = next(members for members in groups if rank in members)
        group = EPGroup(registry().lookup(mine), timeout_s)
        kinds = ("all_to_all",)

    def call(name: str, send: Any, recv: Any) -> None:
        if name == "all_to_all":
            group.all_to_all_single(recv, send, what="calibrate all_to_all")
        else:
            group.all_reduce(send, what="calibrate all_reduce")

    out: dict[str, Any] = {}
    for nbytes in sizes:
        send = torch.full((nbytes // 4,), float(rank), dtype=torch.float32)
        recv = torch.empty_like(send)
        for name in kinds:
            times = []
            for i in range(1 + reps):
                world_group.barrier("calibrate barrier")
                t0 = time.perf_counter()
                call(name, send, recv)
                if i:
                    times.append(time.perf_counter() - t0)
            out[f"{name}:{nbytes}"] = times
    world_group.barrier("calibrate barrier")
    if not warmup:
        return out
    t_load = time.perf_counter()
    with matmul_load() as done:
        for nbytes in sizes:
            send = torch.zeros(nbytes // 4)  # all-reduced in place: zeros stay finite
            recv = torch.empty_like(send)
            for name in kinds:
                key = f"{name}:{nbytes}"
                if key not in warmup:
                    continue
                for _ in range(warmup[key]):
                    call(name, send, recv)
                # A stream's cost per call is its elapsed time over its calls: per-call times
                # also hold a rank's wait for the others' previous call, so their per-call
                # maximum over ranks overstates it (14% on 4 ranks, 0% on 2: measured).
                t0 = time.perf_counter()
                for _ in range(reps):
                    call(name, send, recv)
                out[f"loaded:{key}"] = [(time.perf_counter() - t0) / reps]
    out["load_flops_per_s"] = 2.0 * LOAD_MATMUL**3 * done[0] / (time.perf_counter() - t_load)
    world_group.barrier("calibrate barrier")
    return out


def back_to_back_a2a_s(group: Any, recv: Any, send: Any, calls: int = A2A_CALLS) -> float:
    """This rank's mean seconds a call of ``calls`` all-to-alls issued back to back, each
    waited, after a barrier and one untimed call: the all-to-all's call floor. It is
    ``call(0, b)`` of the desynchronisation waits (:mod:`moesaic.measure.syncwait`), which
    price what a call issued after a stretch of compute waits beyond it. One call timed alone
    after a barrier on its slowest rank (the floor until 2026-12-05) adds the barrier's exit
    skew, which those waits price already: on w32a's cluster (3 ranks, 4 ms) 12.9 ms against
    8.6 ms back to back and 5.9 ms from the last rank's issue (``sim_alone_calls.json``)."""
    group.barrier("calibrate barrier")
    group.all_to_all_single(recv, send, what="calibrate call floor all_to_all")
    t0 = time.perf_counter()
    for _ in range(calls):
        group.all_to_all_single(recv, send, what="calibrate call floor all_to_all")
    return (time.perf_counter() - t0) / calls


def alone_all_reduce_s(group: Any, tensor: Any) -> float:
    """This rank's seconds for one all-reduce of ``tensor`` issued alone after a barrier: how
    a training step's one control collective runs (``TrainStep.step_sums``: every rank comes
    to it from the gradient all-reduce or the end of the backward, nothing else in flight).
    On a long link it costs several of the stream's calls: each exchange of gloo's ring waits
    for its receiver's ready message before the data travel, which a stream's next call hides
    (w32a: 3 ranks at 4 ms, 38.7 ms alone against 17.8 ms a call in a stream; w32c: 8 ranks
    sharing 2 cores across a 1.2 ms link, 40.5 against 23.5, ``allreduce_under_load.py``)."""
    group.barrier("calibrate barrier")
    t0 = time.perf_counter()
    group.all_reduce(tensor, what="calibrate call floor all_reduce alone")
    return time.perf_counter() - t0


def _worker_calls(
    rank: int, world: int, reps: int, stream: int, blocks: int, timeout_s: float
) -> tuple[list[list[float]], list[list[float]], float]:
    """``(idle, loaded, all_to_all)`` seconds of this rank. ``idle``: per repetition (``reps``
    after one warm-up) ``[all_reduce per call, all_reduce alone]``: ``stream`` all-reduces of
    ``CALL_BYTES_PER_PAIR`` bytes issued at once (async) and then waited, their elapsed time
    over ``stream``, after a barrier; one all-reduce of ``ALONE_CALL_BYTES`` alone
    (:func:`alone_all_reduce_s`). ``all_to_all``: a call of ``CALL_BYTES_PER_PAIR`` bytes to
    every rank, back to back (:func:`back_to_back_a2a_s`).
    ``loaded``: per block (``blocks`` of them), ``reps`` such all-reduces each issued alone and
    waited after a barrier (how FlowMoE's pool issues a chunk beside the backward), after one
    warm-up, while a thread of this rank started for the block runs ``LOAD_MATMUL`` matmuls
    (``LOADED_CALL_BLOCKS``)."""

    import torch

    from moesaic.comm.collectives import EPGroup

    group = EPGroup(None, timeout_s)
    send = torch.zeros(world * CALL_BYTES_PER_PAIR // 4)
    recv = torch.empty_like(send)
    grads = [torch.zeros(CALL_BYTES_PER_PAIR // 4) for _ in range(stream)]
    control = torch.zeros(ALONE_CALL_BYTES // 4)
    a2a = back_to_back_a2a_s(group, recv, send)
    idle = []
    for i in range(1 + reps):
        group.barrier("calibrate barrier")
        t0 = time.perf_counter()
        pending = [group.start_all_reduce(g, what="calibrate call floor all_reduce") for g in grads]
        for p in pending:
            p.wait()
        per_call = (time.perf_counter() - t0) / stream
        alone = alone_all_reduce_s(group, control)
        if i:
            idle.append([per_call, alone])
    loaded = []
    for _ in range(blocks):
        times = []
        with matmul_load():
            for i in range(1 + reps):
                group.barrier("calibrate barrier")
                t0 = time.perf_counter()
                group.all_reduce(grads[0], what="calibrate loaded call floor all_reduce")
                if i:
                    times.append(time.perf_counter() - t0)
        loaded.append(times)
    group.barrier("calibrate barrier")
    return idle, loaded, a2a


class CallFloors(NamedTuple):
    """The collectives' measured call floors (:func:`collective_calls`), seconds."""

    a2a_s: float
    allreduce_s: float
    allreduce_loaded_s: float
    allreduce_alone_s: float


def median_calls(rounds: list[CallFloors]) -> CallFloors:
    """Each call floor's median over ``rounds`` (each a :func:`collective_calls` of the same
    cluster)."""
    if not rounds:
        raise ValueError("rounds must hold at least one measurement")
    return CallFloors(*(statistics.median(x) for x in zip(*rounds, strict=True)))


def collective_calls(
    cluster: Any = None,
    *,
    reps: int = CALL_REPS,
    stream: int = CALL_STREAM,
    blocks: int = LOADED_CALL_BLOCKS,
    timeout_s: float = 300.0,
) -> CallFloors:
    """The call floors of a started emulated ``cluster`` (every rank), or of a loopback pair
    without one: for the all-reduces per call the slowest rank's time, then the mean over the
    ``reps`` calls (a step pays every call, its slow ones too), over all ``blocks`` x ``reps``
    for the loaded one; the all-to-all's back-to-back call, the ranks' mean. The machine
    should be otherwise idle: the loaded regime of the shares holds what computing beside a
    collective costs; the loaded all-reduce is the one figure timed beside compute here
    (``_worker_calls``)."""
    check_positive_int("reps", reps)
    check_positive_int("stream", stream)
    check_positive_int("blocks", blocks)
    args = (reps, stream, blocks, timeout_s)
    if cluster is None:
        from moesaic.comm.world import run_world

        per_rank = run_world(_worker_calls, 2, *args, timeout_s=timeout_s)
    else:
        world = cluster.spec.world_size
        per_rank = cluster.run(_worker_calls, world, *args, timeout_s=timeout_s)
    idle = [[max(r[0][i][k] for r in per_rank) for k in range(2)] for i in range(reps)]
    loaded = [max(r[1][b][i] for r in per_rank) for b in range(blocks) for i in range(reps)]
    return CallFloors(
        statistics.fmean(r[2] for r in per_rank),  # the ranks' mean, as the sync waits'
        statistics.fmean(x[0] for x in idle),
        statistics.fmean(loaded),
        statistics.fmean(x[1] for x in idle),
    )


# Put sizes of the put-CPU measurement: a tiny tile (the per-message cost) and a large one
# (the per-byte cost: the kernel's TCP stack and the emulator), 200 and 16 puts.
PUT_SIZES = ((64, 200), (256 * 1024, 16))


def _worker_put_cpu(
    rank: int, world: int, sizes: list[tuple[int, int]], timeout_s: float
) -> list[float]:
    """Ranks 0 and 1: process CPU seconds (every thread) of one step of the taskflow runtime's
    put channel (``comm.channel.PutChannel``) in which 0 puts ``n`` tiles of ``nbytes`` to 1,
    each signalling one event (until 0's sends left and 1's receiving thread took all ``n``),
    per size; the other ranks only join the channel's group and expect no put."""
    import torch

    from moesaic.comm.channel import PutChannel
    from moesaic.comm.collectives import EPGroup
    from moesaic.comm.counters import EventCounters

    group = EPGroup(None, timeout_s)
    channel = PutChannel(group, timeout_s)
    out = []
    for nbytes, n in sizes:
        tile = torch.ones(nbytes // 4)
        receive = torch.zeros(tile.numel() * n if rank == 1 else 1)
        channel.begin(receive, EventCounters(1, rank), n if rank == 1 else 0)
        group.barrier("calibrate barrier")  # the step fence: every rank receives before a put
        t0 = time.process_time()
        if rank == 0:
            for j in range(n):
                channel.put(tile, 1, j * tile.numel(), (0,))
        channel.finish()
        out.append(time.process_time() - t0)
        group.barrier("calibrate barrier")
    return out


def put_cpu(cluster: Any = None, *, timeout_s: float = 120.0) -> tuple[float, float]:
    """``(seconds per put, seconds per byte)`` of CPU that the taskflow runtime's one-sided puts
    (``PutChannel``) cost, sender and receiver together, from ``PUT_SIZES`` between ranks 0 and
    1 of a started emulated ``cluster`` (its first level's link), or a loopback pair without
    one."""
    sizes = list(PUT_SIZES)
    if cluster is None:
        from moesaic.comm.world import run_world

        per_rank = run_world(_worker_put_cpu, 2, sizes, timeout_s, timeout_s=timeout_s)
    else:
        world = cluster.spec.world_size
        per_rank = cluster.run(_worker_put_cpu, world, sizes, timeout_s, timeout_s=timeout_s)
    per_put = [(a + b) / n for a, b, (_, n) in zip(per_rank[0], per_rank[1], sizes)]
    (small, _), (big, _) = sizes
    per_byte = max(0.0, (per_put[1] - per_put[0]) / (big - small))
    return max(0.0, per_put[0] - small * per_byte), per_byte


def share_probe(profile: Profile, a2a_call_s: float, allreduce_call_s: float) -> Profile:
    """The links of ``profile`` (floor, scale, measured levels) with these call floors: what
    collective shares are derived relative to (:func:`collective_share`)."""
    return Profile(
        flops_per_s=1.0,
        floor_s=profile.floor_s,
        bandwidth_scale=profile.bandwidth_scale,
        links=profile.links,
        a2a_call_s=a2a_call_s,
        allreduce_call_s=allreduce_call_s,
    )


def closed_form_s(
    spec: ClusterSpec, profile: Profile, kind: str, bytes_per_rank: float
) -> tuple[float, float]:
    """``(time, latency term)`` of the simulator's ``kind`` collective of ``bytes_per_rank``
    at share 1 on ``spec``'s links as ``profile`` models them for point-to-point, with its
    call floors."""
    from moesaic.sim.collectives import LinkModel, all_to_all_s, ring_all_reduce_s

    link_spec, scale = profile.link_spec(spec)
    link = LinkModel(
        spec=link_spec,
        floor_s=profile.floor_s,
        bandwidth_scale=scale,
        a2a_call_s=profile.a2a_call_s,
        allreduce_call_s=profile.allreduce_call_s,
    )
    P = link.world_size
    if kind == "all_to_all":
        return all_to_all_s(link, bytes_per_rank / P), link.a2a_latency_s()
    latency = max(2 * (P - 1) * link.worst_latency_s(), link.allreduce_call_s)
    return ring_all_reduce_s(link, bytes_per_rank), latency


def collective_share(
    spec: ClusterSpec, profile: Profile, kind: str, bytes_per_rank: float, measured_s: float
) -> float | None:
    """The share of the link rates (as ``profile`` models ``spec``'s links for point-to-point)
    under which the simulator's ``kind`` collective of ``bytes_per_rank`` takes ``measured_s``:
    its bandwidth term at share 1 over the measured time less its latency term. ``None`` when
    the measured time does not exceed the latency term (nothing to attribute to bandwidth)."""
    full, latency = closed_form_s(spec, profile, kind, bytes_per_rank)
    if measured_s <= latency or full <= latency:
        return None
    return (full - latency) / (measured_s - latency)


def warmup_calls(
    spec: ClusterSpec, profile: Profile, kind: str, bytes_per_rank: float, sustain_s: float
) -> int:
    """Untimed calls that precede the timed ones of a loaded stream: enough to last
    ``sustain_s`` at the closed form's share-1 time (at least ``MIN_WARMUP_CALLS``, at most
    ``MAX_WARMUP_CALLS``)."""
    full, _ = closed_form_s(spec, profile, kind, bytes_per_rank)
    return _calls_lasting(sustain_s, full)


def _calls_lasting(sustain_s: float, call_s: float) -> int:
    """Calls of ``call_s`` each that last ``sustain_s``, within ``[MIN_WARMUP_CALLS,
    MAX_WARMUP_CALLS]``."""
    calls = math.ceil(sustain_s / call_s) if call_s > 0 else MAX_WARMUP_CALLS
    return min(MAX_WARMUP_CALLS, max(MIN_WARMUP_CALLS, calls))


def _sizes(spec: ClusterSpec, base_bytes: int) -> list[int]:
    """``COLLECTIVE_SIZES`` x ``base_bytes`` per rank, each a whole number of float32 values
    per rank of the world (``all_to_all_single`` splits evenly)."""
    unit = 4 * spec.world_size
    return sorted({max(unit, int(base_bytes * f) // unit * unit) for f in COLLECTIVE_SIZES})


def _timed_s(runs: list[list[dict[str, Any]]], key: str) -> float:
    """A call's time over the ``runs`` (rounds of per-rank results): per round the mean over
    its calls of the slowest rank, then the median over the rounds."""
    return statistics.median(
        statistics.fmean(max(t) for t in zip(*(r[key] for r in per_rank))) for per_rank in runs
    )


def collective_shares(
    cluster: Any,
    profile: Profile,
    base_bytes: int,
    *,
    reps: int = COLLECTIVE_REPS,
    sustain_s: float = 1.0,
    rounds: int = 1,
    timeout_s: float = 300.0,
) -> tuple[CollectiveShare, ...]:
    """Times a started cluster's all-to-all and all-reduce at ``COLLECTIVE_SIZES`` x
    ``base_bytes`` per rank (slowest rank, *mean* of ``reps``, a stream's elapsed time over
    its ``reps`` timed calls when loaded: a step sums many collectives,
    and on a shaped 2-rank link an all-to-all takes either its bound or twice it, so a median
    reports one mode), idle and, unless ``sustain_s`` is 0, loaded (module docstring), and
    converts each into a :class:`CollectiveShare` relative to ``profile``'s links
    (:func:`collective_share`). With ``rounds`` > 1 all of it is timed that many times and
    each time is the median over the rounds."""
    check_non_negative("sustain_s", sustain_s)
    check_positive_int("rounds", rounds)
    spec: ClusterSpec = cluster.spec
    sizes = _sizes(spec, base_bytes)
    warmup = {
        f"{kind}:{nbytes}": warmup_calls(spec, profile, kind, nbytes, sustain_s)
        for nbytes in sizes
        for kind in ("all_to_all", "all_reduce")
        if sustain_s > 0
    }
    runs = [
        cluster.run(
            _worker_collectives,
            spec.world_size,
            sizes,
            reps,
            warmup,
            timeout_s,
            timeout_s=timeout_s,
        )
        for _ in range(rounds)
    ]
    out = []
    for regime, prefix in (("idle", ""), ("loaded", "loaded:")):
        for nbytes in sizes:
            for kind in ("all_to_all", "all_reduce"):
                key = f"{prefix}{kind}:{nbytes}"
                if key not in runs[0][0]:
                    continue
                measured = _timed_s(runs, key)
                share = collective_share(spec, profile, kind, nbytes, measured)
                if share is not None:
                    point = CollectiveShare(
                        kind=kind,
                        bytes_per_rank=float(nbytes),
                        share=share,
                        measured_s=measured,
                        regime=regime,
                    )
                    out.append(point)
    return tuple(out)


def level_groups(spec: ClusterSpec, level: int) -> list[list[int]]:
    """The groups of ranks that differ only in ``level``'s coordinate (each of that level's
    size), in rank order: HybridEP's gathers and an offset group inside one level run over
    them, all at once."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(spec.world_size):
        coords = spec.coords(rank)
        groups.setdefault(coords[:level] + coords[level + 1 :], []).append(rank)
    return list(groups.values())


def _level_closed_form_s(
    spec: ClusterSpec, profile: Profile, level: int, bytes_per_rank: float
) -> tuple[float, float]:
    """``(time, latency term)`` of :func:`~moesaic.sim.collectives.level_exchange_s` at share
    1 for an all-to-all of ``bytes_per_rank`` per rank inside ``level``."""
    from moesaic.sim.collectives import LinkModel, level_exchange_s

    link_spec, scale = profile.link_spec(spec)
    link = LinkModel(spec=link_spec, floor_s=profile.floor_s, bandwidth_scale=scale)
    size = link_spec.levels[level].size
    return level_exchange_s(link, level, size - 1, bytes_per_rank / size), link.latency_s(level)


def level_shares(
    cluster: Any,
    profile: Profile,
    base_bytes: int,
    *,
    reps: int = COLLECTIVE_REPS,
    sustain_s: float = 1.0,
    rounds: int = 1,
    timeout_s: float = 300.0,
) -> tuple[LevelShare, ...]:
    """On a started cluster of more than one level: per level with more than one member per
    parent (and fewer than the world), an all-to-all over every group of :func:`level_groups`
    at once, at ``COLLECTIVE_SIZES`` x ``base_bytes`` per rank, idle and (unless
    ``sustain_s`` is 0) loaded, timed as :func:`collective_shares` times the world's; each a
    :class:`~moesaic.sim.profile.LevelShare` of ``level_exchange_s``'s share-1 closed form on
    ``profile``'s links. Empty on a one-level cluster (its only exchange is the world's).

    Why: HybridEP's gathers, gradient reduces and an offset group's exchange inside a node run
    over such groups. The world's shares are set by its slowest link; on a machine that moves
    bytes slower than a fast inner link carries them they priced a 2-rank exchange of 1.26
    MB per rank inside a node of 4 Gbit/s at 1.7 ms idle, measured 5.1 ms (``docs/simulator.md``,
    "Exchanges inside one level")."""
    check_non_negative("sustain_s", sustain_s)
    check_positive_int("rounds", rounds)
    spec: ClusterSpec = cluster.spec
    sizes = _sizes(spec, base_bytes)
    out: list[LevelShare] = []
    for level, lv in enumerate(spec.levels):
        if spec.num_levels < 2 or lv.size < 2 or lv.size == spec.world_size:
            continue
        warmup = {
            f"all_to_all:{nbytes}": _calls_lasting(
                sustain_s, _level_closed_form_s(spec, profile, level, nbytes)[0]
            )
            for nbytes in sizes
            if sustain_s > 0
        }
        groups = level_groups(spec, level)
        args = (sizes, reps, warmup, timeout_s, groups)
        runs = [
            cluster.run(_worker_collectives, spec.world_size, *args, timeout_s=timeout_s)
            for _ in range(rounds)
        ]
        for regime, prefix in (("idle", ""), ("loaded", "loaded:")):
            for nbytes in sizes:
                key = f"{prefix}all_to_all:{nbytes}"
                if key not in runs[0][0]:
                    continue
                measured = _timed_s(runs, key)
                full, latency = _level_closed_form_s(spec, profile, level, nbytes)
                if measured <= latency or full <= latency:
                    continue
                share = (full - latency) / (measured - latency)
                out.append(
                    LevelShare(
                        level=level,
                        bytes_per_rank=float(nbytes),
                        share=share,
                        measured_s=measured,
                        regime=regime,
                    )
                )
    return tuple(out)


def measure_links(
    spec: ClusterSpec,
    *,
    duration_s: float = 0.3,
    floor: bool = True,
    sustain_s: float = 1.0,
    sync_reps: int = syncwait.REPS,
    rounds: int = ROUNDS,
    timeout_s: float = 300.0,
) -> LinkCalibration:
    """Brings up ``spec`` (and the unshaped pair when ``floor``) and measures their links.

    Args:
        spec: The cluster to emulate; at least two ranks.
        duration_s: Target time of each bandwidth transfer at the configured rate.
        floor: Also measure the unshaped pair for ``floor_s`` (one more cluster, a few seconds).
        sustain_s: Warm-up of each loaded collective stream, seconds at the links' rate
            (0: idle shares only).
        sync_reps: Rounds per segment and size of what a collective waits for the ranks'
            desynchronisation (step 6 of the module docstring; 0: not measured).
        rounds: Times each of steps 2 to 4 is measured on the cluster, the median of each
            figure kept (``ROUNDS``).
        timeout_s: Bound on each cluster's measurement.

    Raises:
        ValueError: a one-rank cluster (no link to measure).
        moesaic.cluster.ClusterError: the emulated cluster cannot be built (not root, no tc...).
    """
    from moesaic.cluster.netns import EmulatedCluster
    from moesaic.cluster.verify import check

    if not isinstance(spec, ClusterSpec):
        raise ValueError(f"spec must be a ClusterSpec, got {type(spec).__name__}")
    if spec.world_size < 2:
        raise ValueError(f"cluster world_size ({spec.world_size}) must be >= 2 to measure links")
    check_positive("duration_s", duration_s)
    check_positive_int("rounds", rounds)
    floor_s = 0.0
    if floor:
        with EmulatedCluster(UNSHAPED) as cluster:
            unshaped = check(cluster, duration_s=duration_s, timeout_s=timeout_s)
        floor_s = unshaped.levels[0].measured_latency_ms * 1e-3
    with EmulatedCluster(spec) as cluster:
        reports = [
            check(cluster, duration_s=duration_s, timeout_s=timeout_s) for _ in range(rounds)
        ]
        report = reports[0]
        links = median_links([links_from_report(r) for r in reports])
        scale = statistics.median(x.bandwidth_share for x in links)
        calls = median_calls(
            [collective_calls(cluster, timeout_s=timeout_s) for _ in range(rounds)]
        )
        probe = share_probe(
            Profile(flops_per_s=1.0, floor_s=floor_s, bandwidth_scale=scale, links=links),
            calls.a2a_s,
            calls.allreduce_s,
        )
        nbytes = next(iter(report.collectives.values()))["bytes_per_rank"]
        shares = collective_shares(
            cluster, probe, nbytes, sustain_s=sustain_s, rounds=rounds, timeout_s=timeout_s
        )
        inner = level_shares(
            cluster, probe, nbytes, sustain_s=sustain_s, rounds=rounds, timeout_s=timeout_s
        )
        per_put, per_byte = put_cpu(cluster, timeout_s=timeout_s)
        waits = (
            syncwait.measure(
                cluster, nbytes * COLLECTIVE_SIZES[0], reps=sync_reps, timeout_s=timeout_s
            )
            if sync_reps
            else ()
        )
    collectives = {
        name: {k: c[k] for k in ("bytes_per_rank", "median_s", "bound_s")}
        for name, c in report.collectives.items()
    }
    return LinkCalibration(
        links=links,
        bandwidth_scale=scale,
        floor_s=floor_s,
        collectives=collectives,
        shares=shares,
        level_shares=inner,
        put_cpu_s=per_put,
        put_cpu_per_byte_s=per_byte,
        a2a_call_s=calls.a2a_s,
        allreduce_call_s=calls.allreduce_s,
        allreduce_loaded_call_s=calls.allreduce_loaded_s,
        allreduce_alone_call_s=calls.allreduce_alone_s,
        sync_waits=waits,
    )
