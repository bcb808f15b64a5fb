"""Collectives priced between the profile's idle and loaded shares by the compute beside them
(``contention.contend`` with ``idle``, ``CpuModel.collective_load``, built by ``simulate``)."""

from __future__ import annotations

import dataclasses

import pytest
from test_opcal_contention import MODEL, OPS_CAL, SPEC  # the same small model, link and ops

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.contention import CpuModel, contend
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.profile import CollectiveShare, Profile
from moesaic.sim.simulate import SimOptions, SimResult, simulate
from moesaic.trace import busy_time

SIZES = (1e3, 1e5, 1e7)


def _shares(regime: str, share: float) -> tuple[CollectiveShare, ...]:
    return tuple(
        CollectiveShare(kind=kind, bytes_per_rank=b, share=share, regime=regime)
        for kind in ("all_to_all", "all_reduce")
        for b in SIZES
    )


def _profile(*collectives: CollectiveShare, ranks: int = 2) -> Profile:
    return Profile(
        flops_per_s=1e12,
        ops=OPS_CAL,
        cores=2,
        ranks_per_machine=ranks,
        comm_cpu_s=1e-6,
        collectives=collectives,
    )


IDLE, LOADED = _shares("idle", 0.8), _shares("loaded", 0.4)


def _sim(profile: Profile, schedule: str) -> SimResult:
    return simulate(SPEC, MODEL, "dropless", profile, SimOptions(degree=4), schedule=schedule)


def test_collective_load_weighs_this_rank_and_the_others():
    one = CpuModel(cores_per_rank=2.0)
    assert one.collective_load(0.3, 0.9) == pytest.approx(0.3)  # alone: its own compute only
    four = CpuModel(cores_per_rank=0.5, machine_ranks=4)
    assert four.collective_load(0.0, 1 / 3) == pytest.approx(0.25)
    assert four.collective_load(1.0, 1.0) == pytest.approx(1.0)
    assert four.collective_load(2.0, -1.0) == pytest.approx(0.25)  # clamped to 0..1


def test_each_collective_priced_by_the_compute_beside_it():
    """One rank alone: an all-to-all under a compute task is priced loaded, one after it idle,
    one half under it half-way."""
    g = SimGraph()
    work = g.add("compute", SimTask("work", "compute", 2.0))
    g.add("a2a", SimTask("under", "a2a", 1.0, nbytes=10.0))  # loaded 1.0, idle 0.5
    g.add("a2a", SimTask("half", "a2a", 2.0, nbytes=10.0))  # starts at 1.0: half under
    g.add("allreduce", SimTask("after", "allreduce", 1.0, nbytes=10.0), work)
    idle = {"under": 0.5, "half": 1.0, "after": 0.5}
    tl, info = contend(g, g.run(), CpuModel(cores_per_rank=4.0), idle)
    ends = {k: tl.end[k] - tl.start[k] for k in ("under", "half", "after")}
    assert ends["under"] == pytest.approx(1.0)
    assert ends["after"] == pytest.approx(0.5)
    assert 1.0 < ends["half"] < 2.0
    assert info["comm_saved_ms"] == pytest.approx(1e3 * (0.5 + 2.0 - ends["half"]))
    assert 0.0 < info["collective_load"] < 1.0
    # without idle prices nothing changes and no such keys appear
    g2 = SimGraph()
    g2.add("a2a", SimTask("alone", "a2a", 1.0))
    tl2, info2 = contend(g2, g2.run(), CpuModel(cores_per_rank=4.0))
    assert tl2.makespan == pytest.approx(1.0) and "collective_load" not in info2


def test_simulate_prices_between_the_regimes():
    both = _sim(_profile(*IDLE, *LOADED), "vanilla")
    idle = _sim(_profile(*IDLE), "vanilla")
    loaded = _sim(_profile(*LOADED), "vanilla")
    assert idle.iteration_s < both.iteration_s < loaded.iteration_s
    assert "collective_load" not in loaded.details["contention"]
    lam = both.details["contention"]["collective_load"]
    # vanilla: nothing of this rank computes beside its collectives, the other rank's compute
    # fraction (independent phases) is all that loads them
    assert 0.0 < lam < 0.5


def test_overlapped_collectives_are_priced_nearer_loaded():
    profile = _profile(*IDLE, *LOADED)
    vanilla, flowmoe = _sim(profile, "vanilla"), _sim(profile, "flowmoe")
    lam_v = vanilla.details["contention"]["collective_load"]
    assert flowmoe.details["contention"]["collective_load"] > lam_v


def test_one_rank_per_machine_prices_exposed_collectives_idle():
    profile = _profile(*IDLE, *LOADED, ranks=1)
    both, idle = _sim(profile, "vanilla"), _sim(_profile(*IDLE, ranks=1), "vanilla")
    assert both.details["contention"]["collective_load"] == pytest.approx(0.0, abs=1e-9)
    assert both.iteration_s == pytest.approx(idle.iteration_s)


def test_a_kind_measured_loaded_only_stays_loaded():
    """Idle points of the all-to-all only: the all-reduce has no idle price to move toward."""
    idle_a2a = tuple(x for x in IDLE if x.kind == "all_to_all")
    profile = _profile(*idle_a2a, *LOADED, ranks=1)
    result, ref = _sim(profile, "vanilla"), _sim(_profile(*LOADED, ranks=1), "vanilla")
    assert busy_time(result.spans, "allreduce") > 0
    assert busy_time(result.spans, "allreduce") == pytest.approx(busy_time(ref.spans, "allreduce"))
    assert busy_time(result.spans, "a2a") < busy_time(ref.spans, "a2a")


def test_hybrid_keeps_the_domains_it_was_planned_with():
    spec = ClusterSpec(
        levels=(
            Level(name="dc", size=2, bandwidth_gbps=0.05, latency_ms=5.0),
            Level(name="rank", size=2, bandwidth_gbps=10.0, latency_ms=0.05),
        )
    )
    model = dataclasses.replace(MODEL, experts=8)
    profile = _profile(*IDLE, *LOADED, ranks=4)
    out = simulate(spec, model, "hybrid", profile, SimOptions(), schedule="vanilla")
    alone = simulate(spec, model, "hybrid", _profile(*LOADED, ranks=4), schedule="vanilla")
    assert out.details["domain_sizes"] == alone.details["domain_sizes"]
    assert out.iteration_s <= alone.iteration_s + 1e-12


def test_link_model_names_a_bad_regime():
    from moesaic.sim.simulate import link_model

    with pytest.raises(ValueError, match="regime"):
        link_model(SPEC, _profile(*IDLE, *LOADED), regime="busy")
