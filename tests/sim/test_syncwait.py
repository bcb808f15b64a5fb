"""What a collective waits for the ranks' desynchronisation (``moesaic.sim.syncwait``): its
interpolation, its measurement on a loopback pair, its place in the profile and in
``contention.contend``."""

from __future__ import annotations

import dataclasses

import pytest
from test_opcal_contention import MODEL, OPS_CAL  # the same small model and ops

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.measure.syncwait import measure, waits_from
from moesaic.sim.contention import CpuModel, contend
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.profile import Profile, SyncWait
from moesaic.sim.simulate import SimOptions, simulate
from moesaic.sim.syncwait import wait_s

# Two sizes, two segments: 1 ms and 3 ms after 10 ms and 30 ms of compute for a few bytes,
# twice that for 1 MB.
POINTS = (
    SyncWait(compute_s=0.01, bytes_per_rank=32.0, wait_s=0.001),
    SyncWait(compute_s=0.03, bytes_per_rank=32.0, wait_s=0.003),
    SyncWait(compute_s=0.01, bytes_per_rank=1e6, wait_s=0.002),
    SyncWait(compute_s=0.03, bytes_per_rank=1e6, wait_s=0.006),
)


def test_wait_interpolates_segments_and_sizes():
    assert wait_s(POINTS, 0.005, 32) == pytest.approx(0.0005)  # from (0, 0) to the first
    assert wait_s(POINTS, 0.02, 32) == pytest.approx(0.002)
    assert wait_s(POINTS, 0.06, 32) == pytest.approx(0.006)  # proportional beyond the longest
    assert wait_s(POINTS, 0.02, 1e6) == pytest.approx(0.004)
    assert wait_s(POINTS, 0.02, 1e9) == pytest.approx(0.004)  # the nearest size outside
    assert wait_s(POINTS, 0.02, 1) == pytest.approx(0.002)
    middle = wait_s(POINTS, 0.02, (32 * 1e6) ** 0.5)  # half-way in log bytes
    assert middle == pytest.approx(0.003)
    assert wait_s(POINTS, 0.0, 1e6) == 0.0
    assert wait_s((), 0.02, 1e6) == 0.0
    negative = (SyncWait(compute_s=0.01, bytes_per_rank=32.0, wait_s=-0.002),)
    assert wait_s(negative, 0.02, 32) == 0.0  # noise below 0 is not a saving


def test_waits_from_takes_the_calls_beyond_back_to_back():
    ranks = [
        {"c:0.0:32": 0.0, "d:0.0:32": 0.001, "c:0.01:32": 0.010, "d:0.01:32": 0.004},
        {"c:0.0:32": 0.0, "d:0.0:32": 0.001, "c:0.01:32": 0.012, "d:0.01:32": 0.002},
    ]
    (point,) = waits_from(ranks, [0.01], [32])
    assert point.compute_s == pytest.approx(0.011)
    assert point.wait_s == pytest.approx(0.003 - 0.001)


def test_measure_on_a_loopback_pair():
    points = measure(nbytes=4096, segments=(0.002, 0.006), reps=2, timeout_s=120.0)
    assert len(points) == 4
    assert {p.bytes_per_rank for p in points} == {32.0, 4096.0}
    for p in points:  # segments of compute as asked (on the slowest rank), finite waits
        assert p.compute_s > 0
        assert abs(p.wait_s) < 1.0
    with pytest.raises(ValueError, match="segments"):
        measure(segments=(0.0,))
    with pytest.raises(ValueError, match="reps"):
        measure(reps=0)


def test_profile_keeps_its_sync_waits(tmp_path):
    profile = Profile(flops_per_s=1e9, sync_waits=POINTS)
    again = Profile.load(profile.save(tmp_path / "p.json"))
    assert again.sync_waits == POINTS
    with pytest.raises(ValueError, match=r"sync_waits\.compute_s"):
        Profile.from_dict(
            {"flops_per_s": 1e9, "sync_waits": [{"compute_s": 0, "bytes_per_rank": 1, "wait_s": 0}]}
        )
    with pytest.raises(ValueError, match=r"sync_waits\.wait_s"):
        SyncWait(compute_s=1.0, bytes_per_rank=1.0, wait_s=float("nan"))


def test_contend_adds_each_collectives_wait_after_its_compute():
    """A collective after 20 ms of compute waits 2 ms (a few bytes), one right after another
    collective of its lane with no compute between waits nothing."""
    g = SimGraph()
    work = g.add("compute", SimTask("work", "compute", 0.02))
    first = g.add("a2a", SimTask("first", "a2a", 0.001, nbytes=32.0), work)
    g.add("a2a", SimTask("second", "a2a", 0.001, nbytes=32.0), first)
    cpu = CpuModel(cores_per_rank=4.0)
    tl, info = contend(g, g.run(), cpu, waits=POINTS)
    assert tl.end["first"] - tl.start["first"] == pytest.approx(0.003)
    assert tl.end["second"] - tl.start["second"] == pytest.approx(0.001)
    assert info["sync_wait_ms"] == pytest.approx(2.0)
    assert info["compute_added_ms"] == pytest.approx(0.0)
    _, without = contend(g, g.run(), cpu)
    assert "sync_wait_ms" not in without


def test_a_collective_waits_for_the_compute_since_the_ranks_last_met_on_any_lane():
    """FlowMoE's gradient chunks have a lane of their own, and the ranks meet at every
    all-to-all before them: a chunk after 20 ms of compute, 2.5 ms of it after an all-to-all
    ended (15 ms of compute, a 1 ms call and its own 1.5 ms wait), waits for those 2.5 ms
    (0.25 ms), not for the 20 ms since its lane's start (2 ms)."""
    g = SimGraph()
    work = g.add("compute", SimTask("work", "compute", 0.015))
    g.add("a2a", SimTask("x", "a2a", 0.001, nbytes=32.0), work)
    more = g.add("compute", SimTask("more", "compute", 0.005), work)
    g.add("grad", SimTask("chunk", "allreduce", 0.001, nbytes=32.0), more)
    tl, info = contend(g, g.run(), CpuModel(cores_per_rank=4.0), waits=POINTS)
    assert tl.end["x"] == pytest.approx(0.0175)
    assert tl.start["chunk"] == pytest.approx(0.02)
    assert tl.end["chunk"] - tl.start["chunk"] == pytest.approx(0.00125)
    assert info["sync_wait_ms"] == pytest.approx(1.75)


def test_simulate_waits_more_for_blocking_collectives_than_pipelined():
    """On a fast link (compute-bound), vanilla's collectives each follow a stage of compute and
    block: the waits lengthen its step by their sum. FlowMoE's overlap the other microbatches'
    compute: its step grows by under half of its waits."""
    fast = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=20.0, latency_ms=0.01),))
    base = Profile(flops_per_s=1e12, ops=OPS_CAL, cores=2, ranks_per_machine=2, comm_cpu_s=1e-6)
    waited = dataclasses.replace(base, sync_waits=POINTS)
    grown = {}
    for schedule in ("vanilla", "flowmoe"):
        runs = [
            simulate(fast, MODEL, "dropless", p, SimOptions(degree=4), schedule=schedule)
            for p in (base, waited)
        ]
        wait = runs[1].details["contention"]["sync_wait_ms"] * 1e-3
        assert wait > 0
        grown[schedule] = (runs[1].iteration_s - runs[0].iteration_s) / wait
    assert grown["vanilla"] == pytest.approx(1.0, rel=0.1)
    assert grown["flowmoe"] < 0.5
