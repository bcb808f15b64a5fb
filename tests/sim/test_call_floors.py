"""The collectives' measured call floors: a tiny collective's measured time bounds the latency
term of every collective of its kind (``moesaic.sim.collectives``, "Measured call floors"), so
FlowMoE's gradient chunks each pay it; ``calibrate`` measures both floors."""

from __future__ import annotations

import math

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.measure.calibrate import closed_form_s, collective_calls, collective_share
from moesaic.sim.collectives import (
    LinkModel,
    all_to_all_s,
    all_to_all_shares_s,
    hierarchical_all_reduce_s,
    ring_all_reduce_s,
)
from moesaic.sim.grad_chunks import one_tail_chunk
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.simulate import SimOptions, simulate

# 2 DCs x 2 ranks: 2 ms between the DCs, 1 ms inside.
SPEC = ClusterSpec(
    levels=(
        Level(name="dc", size=2, bandwidth_gbps=0.1, latency_ms=2.0),
        Level(name="node", size=2, bandwidth_gbps=0.4, latency_ms=1.0),
    )
)
PAIR = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=0.1),))
TINY = 64.0  # bytes per rank: its bandwidth term is far below a microsecond


def test_the_all_reduce_floor_bounds_the_sum_of_its_step_latencies():
    """Ring: 2 (P - 1) = 6 steps of 2 ms (the worst level) = 12 ms of latency; a floor below it
    changes nothing, one above replaces it and leaves the bandwidth term alone. Hierarchical:
    2 x 1 ms + 2 x 2 ms = 6 ms, the same rule."""
    bare = LinkModel(spec=SPEC)
    for fn, latency in ((ring_all_reduce_s, 12e-3), (hierarchical_all_reduce_s, 6e-3)):
        big = 4e6
        bandwidth = fn(bare, big) - latency
        assert fn(bare, TINY) == pytest.approx(latency, rel=1e-2)
        assert fn(LinkModel(spec=SPEC, allreduce_call_s=latency / 2), big) == fn(bare, big)
        floored = LinkModel(spec=SPEC, allreduce_call_s=0.05)
        assert fn(floored, big) == pytest.approx(bandwidth + 0.05)
        assert fn(floored, TINY) == pytest.approx(0.05, rel=1e-2)
    # the all-to-all's floor does not touch the all-reduce, nor the reverse
    assert ring_all_reduce_s(LinkModel(spec=SPEC, a2a_call_s=1.0), TINY) == pytest.approx(
        12e-3, rel=1e-2
    )
    assert all_to_all_s(LinkModel(spec=SPEC, allreduce_call_s=1.0), TINY) == pytest.approx(
        2e-3, rel=2e-2
    )


def test_the_all_to_all_floor_bounds_its_latency_and_one_rank_groups_pay_none():
    bare, floored = LinkModel(spec=SPEC), LinkModel(spec=SPEC, a2a_call_s=0.01)
    assert all_to_all_s(floored, 1e5) - all_to_all_s(bare, 1e5) == pytest.approx(8e-3)
    shares = [0.25] * 4
    assert all_to_all_shares_s(floored, 1e5, shares) - all_to_all_shares_s(
        bare, 1e5, shares
    ) == pytest.approx(8e-3)
    # domains of the whole world: every offset group is one rank, nothing is exchanged
    assert floored.a2a_latency_s((2, 2)) == 0.0
    assert all_to_all_shares_s(floored, 1e5, [1.0], domain_sizes=(2, 2)) == 0.0
    with pytest.raises(ValueError, match="a2a_call_s"):
        LinkModel(spec=SPEC, a2a_call_s=-1.0)
    with pytest.raises(ValueError, match="allreduce_call_s"):
        LinkModel(spec=SPEC, allreduce_call_s=-1.0)


@pytest.mark.parametrize("kind", ["all_to_all", "all_reduce"])
def test_calibrated_shares_are_relative_to_the_floored_closed_form(kind):
    """The share calibrate derives from a time is the one under which the simulator, with the
    same call floors, gives that time back; a time within the floor holds no bandwidth."""
    floors = Profile(flops_per_s=1.0, a2a_call_s=0.02, allreduce_call_s=0.03)
    nbytes = 4e5
    full, latency = closed_form_s(SPEC, floors, kind, nbytes)
    assert latency == (0.02 if kind == "all_to_all" else 0.03)
    measured = latency + 2 * (full - latency)  # the bandwidth term at half the rate
    share = collective_share(SPEC, floors, kind, nbytes, measured)
    assert share == pytest.approx(0.5)
    kw = "a2a_shares" if kind == "all_to_all" else "allreduce_shares"
    link = LinkModel(spec=SPEC, a2a_call_s=0.02, allreduce_call_s=0.03, **{kw: ((nbytes, share),)})
    again = (
        all_to_all_s(link, nbytes / 4) if kind == "all_to_all" else ring_all_reduce_s(link, nbytes)
    )
    assert again == pytest.approx(measured)
    assert collective_share(SPEC, floors, kind, nbytes, 0.9 * latency) is None


def test_every_gradient_chunk_pays_the_all_reduce_floor(tmp_path):
    """FlowMoE at Sp = G/64 against G/4: without floors the more chunks cost latencies of
    0.1 ms each; with a 2 ms floor every call costs at least that, and the calls that cannot
    hide behind the all-to-alls lengthen the step by it. The chunks completing after the last
    gap (the tail) go as one call whatever Sp is (``one_tail_chunk``, as the pool cuts them).
    The profile round-trips its floors."""
    model = ModelSpec(layers=2, batch=4, seq_len=64, hidden=128, ffn_hidden=256, experts=4, top_k=2)
    G = 2 * (4 * 128 * 8 + 4 * 128 * 128) * 4  # order of the gradients' bytes; Sp from it

    def step(profile: Profile, divisor: int):
        opts = SimOptions(degree=2, sp_bytes=G / divisor)
        return simulate(PAIR, model, "dropless", profile, opts, schedule="flowmoe")

    def calls(result) -> list:
        return [s for s in result.spans if s.resource == "allreduce" and s.kind == "AR"]

    bare = Profile(flops_per_s=1e10)
    floored = Profile(flops_per_s=1e10, allreduce_call_s=2e-3)
    fine, coarse = step(floored, 64), step(floored, 4)
    assert all(s.duration >= 2e-3 - 1e-12 for s in calls(fine) + calls(coarse))
    assert len(calls(fine)) > len(calls(coarse))  # the gaps' chunks: one call each
    # what the floor adds to the step: the busy time of the calls, a floor per call at least
    busy = sum(s.duration for s in calls(fine)) - sum(s.duration for s in calls(step(bare, 64)))
    assert busy > (len(calls(fine)) - 1) * 1.9e-3, busy
    # the tail: the chunks placed after the last gap go as one call of their bytes, ready
    # with the last of them
    chunks = [(10.0, "a"), (20.0, "b"), (30.0, "c"), (40.0, "d")]
    gap, tail = object(), object()
    placed = [(gap, True), (tail, False), (tail, False), (tail, False)]
    merged, where = one_tail_chunk(chunks, placed)  # type: ignore[arg-type]
    assert merged == [(10.0, "a"), (90.0, "d")] and where == [(gap, True), (tail, False)]
    assert one_tail_chunk(chunks[:2], placed[:2]) == (chunks[:2], placed[:2])
    assert Profile.load(floored.save(tmp_path / "p.json")) == floored
    with pytest.raises(ValueError, match=r"profile\.allreduce_call_s"):
        Profile(flops_per_s=1.0, allreduce_call_s=-1e-3)
    with pytest.raises(ValueError, match=r"profile\.a2a_call_s"):
        Profile(flops_per_s=1.0, a2a_call_s=-1e-3)
    with pytest.raises(ValueError, match=r"profile\.allreduce_loaded_call_s"):
        Profile(flops_per_s=1.0, allreduce_loaded_call_s=-1e-3)
    with pytest.raises(ValueError, match=r"profile\.allreduce_alone_call_s"):
        Profile(flops_per_s=1.0, allreduce_alone_call_s=-1e-3)


@pytest.mark.timeout(60)
def test_call_floors_are_measured_on_a_loopback_pair():
    """Two ranks on loopback (~2 s): the floors positive and below 50 ms (gloo on this
    machine: 0.3 ms an all-to-all, 0.9 ms an all-reduce in a stream, measured; the loaded
    all-reduce beside each rank's matmul thread 1-5 ms on these 2 cores; one alone about
    2 ms, more than a call of the stream, which overlaps the next call's handshake)."""
    a2a, allreduce, loaded, alone = collective_calls(reps=2, stream=8, timeout_s=50)
    assert 0.0 < a2a < 0.05 and 0.0 < allreduce < 0.05, (a2a, allreduce)
    assert 0.0 < loaded < 0.5, loaded
    assert 0.0 < alone < 0.05, alone
    assert math.isfinite(a2a + allreduce + loaded + alone)
    with pytest.raises(ValueError, match="stream"):
        collective_calls(stream=0)
