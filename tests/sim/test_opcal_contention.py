"""CPU contention (``moesaic.sim.contention``) on synthetic profiles: ranks against cores, the
communication's CPU against the compute it overlaps, and when it is off."""

from __future__ import annotations

import dataclasses

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.measure.cpuload import comm_cores
from moesaic.sim.contention import LOCKSTEP_RESOURCES, CpuModel, _Load, contend
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.model import ModelSpec
from moesaic.sim.opcal import OPS, OpCal, OpFit
from moesaic.sim.profile import Profile
from moesaic.sim.simulate import SimOptions, SimResult, simulate

MODEL = ModelSpec(
    name="m", layers=2, batch=8, seq_len=16, hidden=64, ffn_hidden=256, experts=4, top_k=2
)
SPEC = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=0.1, latency_ms=0.5),))
# compute and communication of the same order on this link
OPS_CAL = OpCal(
    model=MODEL,
    threads=1,
    expert_count=2,
    tokens=(32, 128),
    fwd={k: OpFit(overhead_s=1e-4, per_unit_s=2e-6) for k in OPS},
    bwd={k: OpFit(overhead_s=2e-4, per_unit_s=4e-6) for k in OPS},
    optimizer=OpFit(overhead_s=1e-4, per_unit_s=1e-9),
)
BASE = Profile(flops_per_s=1e12, ops=OPS_CAL)  # measured alone: one process, an idle machine
RATE = Profile(flops_per_s=2e9, task_overhead_s=1e-4)  # a rate measured with the ranks running


def _sim(profile: Profile, schedule: str = "vanilla") -> SimResult:
    return simulate(SPEC, MODEL, "dropless", profile, SimOptions(degree=4), schedule=schedule)


def test_load_integrates_the_rate_piecewise():
    cpu = CpuModel(cores_per_rank=1.0)
    load = _Load([(1.0, 2.0, 1.0)])  # one core busy communicating from 1 s to 2 s
    assert load.finish(0.0, 0.5, cpu) == pytest.approx(0.5)  # before it: full speed
    # 1 s of work from 0: 1 s at full speed, 0.5 s of work at half speed in [1, 2], 0.5 after
    assert load.finish(0.0, 2.0, cpu) == pytest.approx(2.5)
    assert load.finish(1.5, 1.0, cpu) == pytest.approx(2.75)
    # two cores per rank: one compute thread and one busy core fit, nothing slows
    assert load.finish(0.0, 2.0, CpuModel(cores_per_rank=2.0)) == pytest.approx(2.0)


def test_off_for_older_profiles_and_without_cores():
    cpu_fields = dict(cores=2, ranks_per_machine=2, put_cpu_s=1e-3, put_cpu_per_byte_s=1e-8)
    assert CpuModel.of(dataclasses.replace(RATE, **cpu_fields)) is None  # no comm CPU, no ops
    assert CpuModel.of(dataclasses.replace(BASE, comm_cpu_per_byte_s=1e-8)) is None  # no cores
    on = CpuModel.of(dataclasses.replace(RATE, **cpu_fields, comm_cpu_per_byte_s=1e-8))
    assert on == CpuModel(
        cores_per_rank=1.0, machine_ranks=2, comm_cpu_per_byte_s=1e-8, measured_alone=False
    )
    assert CpuModel.of(dataclasses.replace(BASE, **cpu_fields)) == CpuModel(
        cores_per_rank=1.0, machine_ranks=2
    )
    sim = _sim(dataclasses.replace(RATE, **cpu_fields))  # as every committed profile
    assert "contention" not in sim.details
    with pytest.raises(ValueError, match="cores_per_rank"):
        CpuModel(cores_per_rank=0.0)


def _optimizer_s(sim: SimResult) -> float:
    """The seconds of the simulated step's optimizer task."""
    (span,) = [s for s in sim.spans if s.resource == "optimizer"]
    return span.end - span.start


def test_two_ranks_on_one_core_slow_by_the_other_ranks_compute_fraction():
    """Vanilla is serial: at half a core per rank every compute task of the step takes ``1 + u``
    times as long, ``u`` the other rank's compute fraction (the fixed point's
    ``other_ranks_cores``, no communication CPU here), and the optimizer, which both ranks run
    at once, twice as long (``LOCKSTEP_RESOURCES``); at a core per rank nothing changes."""
    free = _sim(BASE)
    one_core = _sim(dataclasses.replace(BASE, cores=1, ranks_per_machine=2))
    two_cores = _sim(dataclasses.replace(BASE, cores=2, ranks_per_machine=2))
    assert two_cores.iteration_s == pytest.approx(free.iteration_s)
    u = one_core.details["contention"]["other_ranks_cores"]
    assert 0.0 < u < 1.0
    opt = _optimizer_s(free)
    assert opt > 0
    assert _optimizer_s(one_core) == pytest.approx(2 * opt)
    added = u * (free.compute_s - opt) + opt
    assert one_core.compute_s == pytest.approx(free.compute_s + added)
    assert one_core.iteration_s == pytest.approx(free.iteration_s + added)
    # the fixed point: u is the slowed step's compute fraction (to the iterations' precision)
    assert u == pytest.approx(one_core.compute_s / one_core.iteration_s, rel=0.05)
    # a rate measured with the ranks already sharing the cores is not slowed a second time
    shared = dict(cores=1, ranks_per_machine=2, comm_cpu_s=1e-9)
    assert _sim(dataclasses.replace(RATE, **shared)).iteration_s == pytest.approx(
        _sim(RATE).iteration_s
    )


def test_other_ranks_want_their_compute_fraction_and_communication():
    """``O = (m - 1)(u n + Lbar)``; without it every other rank wants what this one does."""
    cpu = CpuModel(cores_per_rank=0.5, machine_ranks=4, threads=1)
    assert cpu.others(0.5, 0.1) == pytest.approx(3 * 0.6)
    assert cpu.slowdown(0.0, cpu.others(0.5, 0.0)) == pytest.approx((1 + 1.5) / 2)
    assert cpu.slowdown(0.2) == pytest.approx(4 * 1.2 / 2)  # the old rule: (n + L) / c
    assert cpu.others(2.0, 0.0) == 3.0  # a fraction is at most 1
    assert CpuModel(cores_per_rank=2.0).others(1.0, 1.0) == 0.0  # one rank on the machine
    with pytest.raises(ValueError, match="machine_ranks"):
        CpuModel(cores_per_rank=1.0, machine_ranks=0)


def test_communication_cpu_slows_the_compute_it_overlaps_only():
    """The same communication CPU slows flowmoe (its compute overlaps all-to-alls) and leaves
    vanilla's forward and backward (compute and communication one after another) as they were;
    only its optimizer, which every rank runs at once, is slowed, by the other rank's
    communication CPU averaged over the step (``Lbar``, kept for the lockstep tail as for every
    task)."""
    hot = dataclasses.replace(BASE, cores=2, ranks_per_machine=2, comm_cpu_per_byte_s=1e-6)
    for schedule in ("vanilla", "flowmoe"):
        free, slowed = _sim(BASE, schedule), _sim(hot, schedule)
        added = slowed.details["contention"]["compute_added_ms"]
        if schedule == "vanilla":
            stretch = _optimizer_s(slowed) - _optimizer_s(free)
            assert added == pytest.approx(stretch * 1e3)
            assert 0 < stretch < 0.5 * _optimizer_s(free)
            assert slowed.iteration_s == pytest.approx(free.iteration_s + stretch)
        else:
            assert added > 0
            assert slowed.compute_s > free.compute_s
            assert slowed.iteration_s >= free.iteration_s - 1e-12
            # at most one core's worth of communication: compute at most twice as long
            assert slowed.compute_s <= 2 * free.compute_s + 1e-9


def test_a_busy_link_costs_per_byte_and_call():
    cpu = CpuModel(cores_per_rank=1.0, comm_cpu_s=1e-3, comm_cpu_per_byte_s=1e-9)
    task = SimTask("D1.1", "a2a", 0.1, nbytes=1e6)
    assert cpu.load(task, 0.1) == pytest.approx((1e-3 + 1e-3) / 0.1)
    assert cpu.load(task, 1e-6) == 1.0  # at most one thread's worth
    assert cpu.slowdown(0.5) == pytest.approx(1.5)
    assert CpuModel(cores_per_rank=2.0, threads=1).slowdown(0.5) == 1.0
    # measured with two ranks on one core already: only the communication's share on top
    assert CpuModel(cores_per_rank=0.5, measured_alone=False).slowdown(0.5) == pytest.approx(1.5)


def test_busy_communication_costs_for_as_long_as_it_runs():
    """``comm_cpu_busy``: cores a collective keeps busy whatever its bytes, on top of the rest;
    a profile with it alone has a CPU model."""
    cpu = CpuModel(cores_per_rank=1.0, comm_cpu_busy=0.2, comm_cpu_per_byte_s=1e-9)
    task = SimTask("C1.1", "a2a", 0.1, nbytes=1e6)
    assert cpu.load(task, 0.1) == pytest.approx(0.2 + 1e-3 / 0.1)
    assert cpu.load(task._replace(nbytes=0.0), 10.0) == pytest.approx(0.2)
    profile = dataclasses.replace(RATE, cores=2, ranks_per_machine=2, comm_cpu_busy=0.2)
    assert CpuModel.of(profile) == CpuModel(
        cores_per_rank=1.0, machine_ranks=2, comm_cpu_busy=0.2, measured_alone=False
    )
    with pytest.raises(ValueError, match=r"profile\.comm_cpu_busy"):
        dataclasses.replace(RATE, comm_cpu_busy=1.5)


@pytest.mark.parametrize(
    "slowdown, threads, cores, want",
    [
        (1.27, 1, 1.0, 0.27),  # one thread on its core: s = 1 + L
        (1.5, 1, 0.5, 0.5),  # two ranks per core, slowed relative to that: s = 1 + L
        (1.0, 1, 2.0, 0.0),  # room on the cores: nothing slowed, nothing inferred
        (1.25, 1, 2.0, 1.5),  # slowed with a spare core: L filled it and more
        (0.9, 2, 1.0, 0.0),  # faster (noise): 0
    ],
)
def test_comm_cores_inverts_the_fair_share(slowdown, threads, cores, want):
    got = comm_cores(slowdown, threads, cores)
    assert got == pytest.approx(want)
    if got > 0:  # the contention model gives the slowdown back
        cpu = CpuModel(cores_per_rank=cores, threads=threads, measured_alone=False)
        assert cpu.slowdown(got) == pytest.approx(slowdown)


def test_the_optimizer_runs_beside_every_other_rank():
    """``contend`` on a graph of one stage and the optimizer, 4 ranks on 2 cores: the stage is
    slowed by the other ranks' compute fraction, ``(1 + 3u) / 2``, the optimizer as if all
    three computed, ``(1 + 3) / 2``."""
    g = SimGraph()
    stage = g.add("compute", SimTask("AT1.1", "compute", 1.0))
    g.add("a2a", SimTask("D1.1", "a2a", 3.0, nbytes=1.0), stage)
    g.add("compute", SimTask("optimizer", "optimizer", 0.5), "D1.1")
    cpu = CpuModel(cores_per_rank=0.5, machine_ranks=4)
    tl, info = contend(g, g.run(), cpu)
    u = info["other_ranks_cores"] / 3
    assert 0.0 < u < 0.5
    assert tl.end["AT1.1"] - tl.start["AT1.1"] == pytest.approx((1 + 3 * u) / 2)
    assert tl.end["optimizer"] - tl.start["optimizer"] == pytest.approx(0.5 * 2)
    assert "optimizer" in LOCKSTEP_RESOURCES
