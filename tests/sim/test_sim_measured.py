"""Measured calibration in the simulator: the collectives' measured shares (each applied to its
own collective only) and the taskflow runtime's CPU (per tile, per put, the cores floor)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.measure.calibrate import collective_share, put_cpu
from moesaic.sim.collectives import (
    LinkModel,
    all_gather_s,
    all_to_all_s,
    all_to_all_shares_s,
    all_to_all_v_s,
    hierarchical_all_reduce_s,
    level_exchange_s,
    p2p_s,
    ring_all_reduce_s,
)
from moesaic.sim.hybrid import hybrid_parts
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import CollectiveShare, Profile
from moesaic.sim.simulate import SimOptions, simulate
from moesaic.sim.taskflow import layer_plan, model_bucket
from moesaic.taskflow.bucket import CompileOptions
from moesaic.taskflow.compile import compile_world
from moesaic.taskflow.moe_graphs import TASK_TYPES

ROOT = Path(__file__).resolve().parents[2]
LAYER = ModelSpec.from_toml(ROOT / "examples/models/taskflow_layer.toml")
SPEC = ClusterSpec(
    levels=(
        Level(name="dc", size=2, bandwidth_gbps=0.1, latency_ms=2.0),
        Level(name="node", size=2, bandwidth_gbps=0.4, latency_ms=1.0),
    )
)
PAIR = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=0.1),))
ONE = ((1.0, 1.0),)
HALF = ((1.0, 0.5),)


def test_share_interpolates_in_log_size_and_clamps():
    link = LinkModel(spec=SPEC, a2a_shares=((1e5, 0.5), (1e7, 1.0)))
    assert link.share("all_to_all", 1e3) == 0.5  # below the measured sizes: the smallest
    assert link.share("all_to_all", 1e5) == 0.5
    assert link.share("all_to_all", 1e6) == pytest.approx(0.75)  # halfway in log size
    assert link.share("all_to_all", 1e9) == 1.0
    assert link.share("all_reduce", 1e6) == 1.0  # none measured
    with pytest.raises(ValueError, match="a2a_shares"):
        LinkModel(spec=SPEC, a2a_shares=((1e7, 1.0), (1e5, 0.5)))  # unsorted
    with pytest.raises(ValueError, match="share"):
        LinkModel(spec=SPEC, allreduce_shares=((1e5, 0.0),))


def _bandwidth_term(fn, shares_kw: dict) -> float:
    """The bandwidth term of ``fn(link)`` with the shares: it halves when the links' rates double
    (``bandwidth_scale`` 2) and the latency term does not, so it is twice the difference."""
    one = fn(LinkModel(spec=SPEC, **shares_kw))
    return 2 * (one - fn(LinkModel(spec=SPEC, bandwidth_scale=2.0, **shares_kw)))


A2A = {
    "all_to_all": lambda link: all_to_all_s(link, 1e5),
    # the share is the uniform exchange's loss (a skewed one: test below)
    "all_to_all_shares": lambda link: all_to_all_shares_s(link, 4e5, [0.25] * 4),
    "all_to_all_v": lambda link: all_to_all_v_s(
        link, [[0.0 if i == j else 1e5 for j in range(4)] for i in range(4)]
    ),
    "level_exchange": lambda link: level_exchange_s(link, 0, 1, 1e5),
    # HybridEP's gradient reduce: the runtime's adjoint of the gathers is an all-to-all per level
    "hybrid gradient reduce": lambda link: hybrid_parts(link, LAYER, (2, 2), 1e12).grad_reduce,
}
AR = {
    "ring_all_reduce": lambda link: ring_all_reduce_s(link, 1e6),
    "all_gather": lambda link: all_gather_s(link, 1e5),
    "hierarchical_all_reduce": lambda link: hierarchical_all_reduce_s(link, 1e6),
    "gather (level_exchange)": lambda link: level_exchange_s(link, 0, 1, 1e5, gather=True),
    "hybrid expert gathers": lambda link: hybrid_parts(link, LAYER, (2, 2), 1e12).gather,
}


def test_a_skewed_all_to_all_is_its_busiest_link_or_the_uniform_one_as_measured():
    """The measured share is a uniform exchange's loss (every link busy both ways); a skewed
    exchange's busiest link, fed by several senders, moves at its rate: the exchange takes the
    longer of that and the uniform exchange with its share."""
    D, three_quarters = 4e5, ((1.0, 0.75), (1e9, 0.75))
    full = LinkModel(spec=SPEC)
    shared = LinkModel(spec=SPEC, a2a_shares=three_quarters)
    lat = all_to_all_shares_s(full, 0.0, [0.25] * 4)

    def bw(link, shares):
        return all_to_all_shares_s(link, D, shares) - lat

    even = bw(full, [0.25] * 4)
    assert bw(shared, [0.25] * 4) == pytest.approx(even / 0.75)
    mild = [0.3, 0.3, 0.2, 0.2]  # its busiest (dc) link carries 1.2x the uniform bytes
    assert bw(full, mild) == pytest.approx(1.2 * even)
    assert bw(shared, mild) == pytest.approx(even / 0.75)
    hot = [0.85, 0.05, 0.05, 0.05]  # 1.8x: longer than the uniform exchange as measured
    assert bw(full, hot) == pytest.approx(1.8 * even)
    assert bw(shared, hot) == pytest.approx(1.8 * even)


@pytest.mark.parametrize("name", [*A2A, *AR])
def test_each_share_prices_its_own_collective_only(name):
    """A share of 0.5 doubles the bandwidth term of its collectives and leaves the others (and
    point-to-point messages) as they were; latencies never change."""
    fn = A2A.get(name) or AR[name]
    own, other = (
        ("a2a_shares", "allreduce_shares") if name in A2A else ("allreduce_shares", "a2a_shares")
    )
    base = _bandwidth_term(fn, {})
    assert base > 0
    assert _bandwidth_term(fn, {own: HALF}) == pytest.approx(2 * base, rel=1e-9)
    assert _bandwidth_term(fn, {other: HALF}) == pytest.approx(base, rel=1e-12)
    plain = p2p_s(LinkModel(spec=SPEC), 0, 3, 1e6)
    assert p2p_s(LinkModel(spec=SPEC, a2a_shares=HALF, allreduce_shares=HALF), 0, 3, 1e6) == plain


def test_profile_collectives_reach_the_simulation_and_round_trip(tmp_path):
    model = ModelSpec(layers=2, batch=2, seq_len=64, hidden=64, ffn_hidden=128, experts=4, top_k=2)
    base = Profile(flops_per_s=1e10)
    slow_a2a = Profile(
        flops_per_s=1e10,
        collectives=(CollectiveShare(kind="all_to_all", bytes_per_rank=1e5, share=0.5),),
    )
    a = simulate(SPEC, model, "dropless", base)
    b = simulate(SPEC, model, "dropless", slow_a2a)
    a2a = [s for s in b.spans if s.resource == "a2a"]
    ar = [s for s in b.spans if s.resource == "allreduce"]
    assert a2a and ar
    base_a2a = [s for s in a.spans if s.resource == "a2a"]
    assert a2a[0].duration > 1.5 * base_a2a[0].duration
    base_ar = next(s for s in a.spans if s.resource == "allreduce")
    assert ar[0].duration == pytest.approx(base_ar.duration)
    assert Profile.load(slow_a2a.save(tmp_path / "p.json")) == slow_a2a
    with pytest.raises(ValueError, match=r"collectives\.kind"):
        Profile.from_dict(
            {
                "flops_per_s": 1.0,
                "collectives": [{"kind": "broadcast", "bytes_per_rank": 1.0, "share": 1.0}],
            }
        )


@pytest.mark.parametrize("kind", ["all_to_all", "all_reduce"])
def test_collective_share_inverts_the_closed_form(kind):
    """The share calibrate derives from a time is the one under which the simulator gives it."""
    nbytes = 4e5
    kw = "a2a_shares" if kind == "all_to_all" else "allreduce_shares"
    link = LinkModel(spec=SPEC, **{kw: ((nbytes, 0.6),)})
    t = all_to_all_s(link, nbytes / 4) if kind == "all_to_all" else ring_all_reduce_s(link, nbytes)
    assert collective_share(SPEC, Profile(flops_per_s=1.0), kind, nbytes, t) == pytest.approx(0.6)
    # Faster than the latencies alone: nothing to attribute to bandwidth.
    assert collective_share(SPEC, Profile(flops_per_s=1.0), kind, nbytes, 1e-4) is None


def _remote_puts(direction: str, tile_m: int) -> int:
    bucket = model_bucket(LAYER, ep_size=2, slot_rows=512, tile_m=tile_m)
    plan = compile_world(bucket, direction, CompileOptions())[0]
    return sum(
        1
        for t in plan.tasks
        if TASK_TYPES[t.task_type].put and (t.peer if t.peer >= 0 else t.outputs[0].rank) != 0
    )


def test_taskflow_puts_take_the_all_to_all_share():
    """A layer's puts are its exchange cut into tiles: their wire time is divided by the
    all-to-all's share at T K H bytes per rank; the all-reduce's share leaves them alone."""
    zero = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=0.0),))
    prof = Profile(flops_per_s=1e10)

    def put_seconds(**shares) -> float:
        plan = layer_plan(
            LAYER, LinkModel(spec=zero, **shares), prof, "forward", tile_m=512, slot_rows=512
        )
        return math.fsum(s.end - s.start for s in plan.spans if s.resource == "a2a")

    base = put_seconds()
    assert base > 0
    assert put_seconds(a2a_shares=HALF) == pytest.approx(2 * base, rel=1e-9)
    assert put_seconds(allreduce_shares=HALF) == pytest.approx(base, rel=1e-12)


def test_put_and_tile_cpu_are_charged_per_put_and_per_tile():
    link = LinkModel(spec=PAIR)

    def forward(**cpu: float):
        profile = Profile(flops_per_s=1e10, **cpu)
        return layer_plan(LAYER, link, profile, "forward", tile_m=512, slot_rows=512)

    plain = forward()
    puts = _remote_puts("forward", 512)
    assert puts > 0
    per_put = forward(put_cpu_s=1e-3)
    assert per_put.cpu_s - plain.cpu_s == pytest.approx(puts * 1e-3)
    assert per_put.makespan > plain.makespan  # the queues carry it
    tiles = len(plain.spans)
    per_tile = forward(tile_cpu_s=1e-4)
    assert per_tile.cpu_s - plain.cpu_s == pytest.approx(tiles * 1e-4)
    # Bytes: every remote put carries rows x H x 4 B; 1 ns per byte adds their total.
    per_byte = forward(put_cpu_per_byte_s=1e-9)
    # The forward's dispatch sends half of the T K rows to the peer, the combine returns as many.
    sent = 2 * LAYER.tokens * LAYER.top_k / 2 * LAYER.hidden * LAYER.act_bytes
    assert per_byte.cpu_s - plain.cpu_s == pytest.approx(sent * 1e-9, rel=1e-6)


def test_cores_floor_the_taskflow_iteration():
    """With one core for two ranks a step takes at least twice its CPU time; without cores in
    the profile there is no floor; the other strategies are not floored."""
    opts = SimOptions(taskflow_tile_m=512, taskflow_slot_rows=512)
    cpu = dict(flops_per_s=1e9, put_cpu_s=2e-3)
    free = simulate(PAIR, LAYER, "taskflow", Profile(**cpu), opts)
    assert free.details["cpu_floor_ms"] == 0.0
    assert free.iteration_s < 2 * free.details["cpu_ms"] * 1e-3
    shared = simulate(PAIR, LAYER, "taskflow", Profile(**cpu, cores=1, ranks_per_machine=2), opts)
    assert shared.details["cpu_ms"] == pytest.approx(free.details["cpu_ms"])
    assert shared.details["cpu_floor_ms"] == pytest.approx(2 * free.details["cpu_ms"])
    assert shared.iteration_s == pytest.approx(2 * free.details["cpu_ms"] * 1e-3)
    roomy = simulate(PAIR, LAYER, "taskflow", Profile(**cpu, cores=8, ranks_per_machine=2), opts)
    assert roomy.iteration_s == pytest.approx(free.iteration_s)
    v = simulate(PAIR, LAYER, "dropless", Profile(**cpu, cores=1, ranks_per_machine=2))
    assert v.iteration_s == simulate(PAIR, LAYER, "dropless", Profile(**cpu)).iteration_s
    with pytest.raises(ValueError, match=r"profile\.cores"):
        Profile(flops_per_s=1.0, cores=-1)


@pytest.mark.timeout(60)
def test_put_cpu_is_measured_on_a_loopback_pair():
    """Two ranks, real one-sided puts (~2 s): a positive cost per put, a non-negative per byte,
    both in a plausible range for gloo on a CPU (us per put, below 1 us per KB)."""
    per_put, per_byte = put_cpu()
    assert 1e-6 < per_put < 0.05, per_put
    assert 0.0 <= per_byte < 1e-6, per_byte
    assert math.isfinite(per_put + per_byte)


def test_loaded_shares_price_the_collectives_and_old_profiles_stay_idle(tmp_path):
    """A profile's ``"loaded"`` shares (collectives timed while the ranks compute) price the
    simulation when present: half the idle share makes the all-to-alls slower than the idle
    shares alone would; a profile written before the regime existed loads as idle."""
    model = ModelSpec(layers=2, batch=2, seq_len=64, hidden=64, ffn_hidden=128, experts=4, top_k=2)
    idle = CollectiveShare(kind="all_to_all", bytes_per_rank=1e5, share=0.8)
    loaded = CollectiveShare(kind="all_to_all", bytes_per_rank=1e5, share=0.4, regime="loaded")
    both = Profile(flops_per_s=1e10, collectives=(idle, loaded))
    assert both.collective_shares("all_to_all") == ((1e5, 0.4),)
    assert both.collective_shares("all_to_all", "idle") == ((1e5, 0.8),)
    # No loaded all-reduce points: the all-reduce falls back to its idle ones (none here).
    assert both.collective_shares("all_reduce") == ()

    def a2a_s(profile: Profile) -> float:
        sim = simulate(SPEC, model, "dropless", profile)
        return sum(s.duration for s in sim.spans if s.resource == "a2a")

    t_idle = a2a_s(Profile(flops_per_s=1e10, collectives=(idle,)))
    t_loaded = a2a_s(both)
    assert t_loaded > 1.5 * t_idle
    # Backwards compatible: an old file's record has no regime, and is idle.
    old = {
        "flops_per_s": 1e10,
        "collectives": [
            {"kind": "all_to_all", "bytes_per_rank": 1e5, "share": 0.8, "measured_s": 0.01}
        ],
    }
    assert Profile.from_dict(old).collectives == (idle.__class__(**old["collectives"][0]),)
    assert Profile.from_dict(old).collectives[0].regime == "idle"
    assert Profile.load(both.save(tmp_path / "p.json")) == both
    with pytest.raises(ValueError, match=r"collectives\.regime"):
        CollectiveShare(kind="all_to_all", bytes_per_rank=1.0, share=1.0, regime="busy")


def test_warmup_calls_last_the_sustain_time():
    """A loaded stream's warm-up lasts ``sustain_s`` at the closed form's share-1 time, within
    its bounds; 0 s still warms up with the fewest calls."""
    from moesaic.measure import calibrate as cal

    probe = Profile(flops_per_s=1.0)
    full, _ = cal.closed_form_s(PAIR, probe, "all_to_all", 1e6)
    assert cal.warmup_calls(PAIR, probe, "all_to_all", 1e6, 1.0) == math.ceil(1.0 / full)
    assert cal.warmup_calls(PAIR, probe, "all_to_all", 1e6, 0.0) == cal.MIN_WARMUP_CALLS
    assert cal.warmup_calls(PAIR, probe, "all_reduce", 8.0, 1e3) == cal.MAX_WARMUP_CALLS
