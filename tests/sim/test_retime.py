"""Re-timing a profile's compute to the machine's speed now (``moesaic.measure.retime``,
``Profile.slowed``, ``simulate/plan --retime``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import moesaic.measure.opmeasure as opmeasure
from moesaic.cli import main
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.measure.retime import retime, speed_factor
from moesaic.sim.model import ModelSpec
from moesaic.sim.opcal import OPS, OpCal, OpFit
from moesaic.sim.profile import CollectiveShare, Profile
from moesaic.sim.simulate import SimOptions, simulate

MODEL = ModelSpec(
    name="tiny", layers=1, batch=2, seq_len=8, hidden=16, ffn_hidden=32, experts=2, top_k=1, heads=2
)
# the same model as a model file
TOML = "[model]\n" + "".join(
    f"{k} = {v!r}\n".replace("'", '"')
    for k, v in dataclasses.asdict(MODEL).items()
    if k
    in ("name", "layers", "batch", "seq_len", "hidden", "ffn_hidden", "experts", "top_k", "heads")
)
CLUSTER = """name = "pair"
world_size = 2

[[levels]]
name = "node"
size = 2
bandwidth_gbps = 1.0
latency_ms = 0.1
"""


def _cal(reference_s: float = 0.01) -> OpCal:
    fits = {
        k: OpFit(overhead_s=1e-3 * (i + 1), per_unit_s=1e-6 * (i + 1)) for i, k in enumerate(OPS)
    }
    return OpCal(
        model=MODEL,
        threads=1,
        expert_count=1,
        tokens=(8, 16),
        fwd=fits,
        bwd={k: v.slowed(2.0) for k, v in fits.items()},
        optimizer=OpFit(overhead_s=2e-4, per_unit_s=1e-9),
        op_overhead_s=3e-6,
        reference_s=reference_s,
    )


def _profile(reference_s: float = 0.01) -> Profile:
    return Profile(
        flops_per_s=1e10,
        half_flops_per_s=4e10,
        router_flops_per_s=1e10,
        task_overhead_s=1e-4,
        floor_s=2e-4,
        tile_cpu_s=5e-5,
        put_cpu_s=1e-5,
        put_cpu_per_byte_s=1e-9,
        tile_elem_cpu_s=2e-9,
        copy_elem_cpu_s=1e-9,
        comm_cpu_s=1e-4,
        comm_cpu_per_byte_s=2e-9,
        comm_cpu_busy=0.3,
        a2a_call_s=1e-3,
        allreduce_call_s=5e-4,
        collectives=(
            CollectiveShare(kind="all_to_all", bytes_per_rank=1e5, share=0.5, measured_s=1e-3),
        ),
        ops=_cal(reference_s),
    )


def test_slowed_scales_the_compute_and_cpu_figures_and_keeps_the_network():
    p = _profile()
    s = p.slowed(2.0, why="test")
    assert (s.flops_per_s, s.half_flops_per_s, s.router_flops_per_s) == (5e9, 2e10, 5e9)
    for name in (
        "task_overhead_s",
        "tile_cpu_s",
        "put_cpu_s",
        "put_cpu_per_byte_s",
        "tile_elem_cpu_s",
        "copy_elem_cpu_s",
        "comm_cpu_s",
        "comm_cpu_per_byte_s",
    ):
        assert getattr(s, name) == pytest.approx(2 * getattr(p, name)), name
    for name in ("floor_s", "comm_cpu_busy", "a2a_call_s", "allreduce_call_s", "collectives"):
        assert getattr(s, name) == getattr(p, name), name
    for k in OPS:
        for table in ("fwd", "bwd"):
            new, old = getattr(s.ops, table)[k], getattr(p.ops, table)[k]
            assert new.overhead_s == pytest.approx(2 * old.overhead_s)
            assert new.per_unit_s == pytest.approx(2 * old.per_unit_s)
    assert s.ops.optimizer.seconds(1e6) == pytest.approx(2 * p.ops.optimizer.seconds(1e6))
    assert s.ops.reference_s == pytest.approx(0.02) and s.ops.op_overhead_s == pytest.approx(6e-6)
    assert s.source.endswith("compute x2 (test)")
    with pytest.raises(ValueError, match=r"factor \(0\.0\) must be a finite number > 0"):
        p.slowed(0.0)


def test_a_slowed_profile_simulates_its_compute_that_much_longer():
    spec = ClusterSpec(levels=(Level(name="node", size=2, bandwidth_gbps=1.0, latency_ms=0.1),))
    p = dataclasses.replace(_profile(), comm_cpu_s=0.0, comm_cpu_per_byte_s=0.0)
    for schedule in ("vanilla", "moe-only", "flowmoe"):
        a = simulate(spec, MODEL, "dropless", p, SimOptions(degree=2), schedule=schedule)
        b = simulate(
            spec, MODEL, "dropless", p.slowed(1.5), SimOptions(degree=2), schedule=schedule
        )
        assert b.compute_s == pytest.approx(1.5 * a.compute_s, rel=1e-6), schedule
        assert b.comm_s == pytest.approx(a.comm_s, rel=1e-6), schedule


def test_speed_factor_is_now_over_then_and_refuses_what_it_cannot_retime():
    assert speed_factor(_profile(0.01), 0.015) == pytest.approx(1.5)
    with pytest.raises(
        ValueError, match=r"needs a profile with a speed reference.*calibrate again"
    ):
        speed_factor(_profile(0.0), 0.01)
    with pytest.raises(ValueError, match="needs a profile with a speed reference"):
        speed_factor(dataclasses.replace(_profile(), ops=None), 0.01)
    with pytest.raises(ValueError, match="re-times a CPU profile; this one was measured on 'cuda'"):
        speed_factor(dataclasses.replace(_profile(), device="cuda"), 0.01)
    with pytest.raises(ValueError, match=r"reference_now_s \(0\) must be > 0"):
        speed_factor(_profile(), 0)


def test_retime_times_the_profiles_own_reference(monkeypatch):
    calls = []

    def fake(model, *, threads, repeats):
        calls.append((model, threads, repeats))
        return 0.025

    monkeypatch.setattr(opmeasure, "reference_s", fake)
    out, factor = retime(_profile(0.01))
    assert factor == pytest.approx(2.5)
    assert calls == [(MODEL, 1, opmeasure.REFERENCE_REPEATS)]
    assert out.flops_per_s == pytest.approx(4e9) and out.ops.reference_s == pytest.approx(0.025)
    assert "reference 25.0 ms now, 10.0 ms measured" in out.source


def test_reference_of_the_real_model_is_timed():
    t = opmeasure.reference_s(MODEL, repeats=3)
    assert 0 < t < 5
    with pytest.raises(ValueError, match=r"repeats \(0\) must be"):
        opmeasure.reference_s(MODEL, repeats=0)


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_the_retime_option(tmp_path, capsys, command):
    (tmp_path / "m.toml").write_text(TOML)
    (tmp_path / "c.toml").write_text(CLUSTER)
    base = [command, "--cluster", str(tmp_path / "c.toml"), "--model", str(tmp_path / "m.toml")]
    base += ["--json"]
    if command == "simulate":
        base += ["--strategy", "dropless"]
    assert main([*base, "--retime"]) == 2
    assert "--retime re-times a --profile; give one" in capsys.readouterr().err
    old = tmp_path / "old.json"
    _profile(0.0).save(old)
    assert main([*base, "--profile", str(old), "--retime"]) == 2
    assert "calibrate again" in capsys.readouterr().err
    # a reference 1000 s long at calibration: the machine now runs far faster than then
    slow = tmp_path / "slow.json"
    _profile(1000.0).save(slow)

    def run(extra: list[str]) -> tuple[float, str]:
        assert main([*base, "--profile", str(slow), *extra]) == 0
        captured = capsys.readouterr()
        out = json.loads(captured.out)
        row = out[0] if isinstance(out, list) else out
        return row["iteration_ms" if command == "simulate" else "predicted_ms"], captured.err

    plain, _ = run([])
    fast, err = run(["--retime"])
    assert fast < plain
    assert "--retime: the machine runs 0.00x the time of --profile" in err
    assert "network figures as measured" in err
