"""``moesaic simulate``'s guards (issue 25, items 5-7): a profile measured on another cluster,
``--strategy all`` (every strategy under every schedule) with ``--csv``/``--png``/``--trace``
and on worlds taskflow cannot run, and ``--flops-per-s`` refused when not a positive finite
rate or applied over a profile."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from moesaic.cli import main
from moesaic.cluster.spec import ClusterSpec
from moesaic.sim.profile import LinkLevel, Profile
from moesaic.sim.runs import runs

ROOT = Path(__file__).resolve().parents[2]
RUNS = [r.name for r in runs("all", "all")]  # dropless+vanilla, ..., taskflow+vanilla
CLUSTERS = ROOT / "examples/clusters"
RESULTS = ROOT / "benchmarks/results"
FLOWMOE_CLUSTER = str(CLUSTERS / "flowmoe_2rank.toml")
FLOWMOE_MODEL = str(ROOT / "examples/models/flowmoe_small.toml")
HYBRID_MODEL = str(ROOT / "examples/models/hybridep_small.toml")


def _simulate(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["simulate", "--routing", "uniform", *args])  # the tests' rates are uniform's
    out = capsys.readouterr()
    return rc, out.out, out.err


def _recorded(tmp_path: Path, profile: str, cluster: str) -> str:
    """A committed profile with the cluster it was measured on recorded, as calibrate now
    writes it."""
    data = json.loads((RESULTS / profile).read_text())
    data["cluster"] = ClusterSpec.from_toml(CLUSTERS / cluster).to_dict()
    path = tmp_path / profile
    path.write_text(json.dumps(data))
    return str(path)


# ------------------------------------------------------------------ item 6: profile's cluster
def test_profile_round_trips_its_cluster(tmp_path):
    spec = ClusterSpec.from_toml(CLUSTERS / "hybridep_2dc2.toml")
    path = Profile(flops_per_s=1e11, cluster=spec).save(tmp_path / "p.json")
    assert Profile.load(path).cluster == spec
    assert Profile.load(path).cluster_differences(spec) == []
    with pytest.raises(ValueError, match=r"profile\.cluster: .*levels"):
        Profile.from_dict({"flops_per_s": 1e11, "cluster": {"name": "x"}})


def test_calibrate_cluster_records_the_cluster(capsys, tmp_path, monkeypatch):
    """``calibrate --cluster`` writes the cluster it measured (links faked: no root here; the
    emulated run is ``test_sim_calibrate.py``'s netns test)."""
    import moesaic.measure.calibrate as cal

    link = LinkLevel(
        level_name="datacenter",
        configured_bandwidth_gbps=0.1,
        measured_bandwidth_gbps=0.09,
        configured_latency_ms=2.0,
        measured_latency_ms=2.1,
    )
    fake = cal.LinkCalibration(links=(link,), bandwidth_scale=0.9, floor_s=1e-4, collectives={})
    monkeypatch.setattr(cal, "measure_links", lambda *a, **k: fake)
    out = tmp_path / "p.json"
    toml = CLUSTERS / "hybridep_2dc.toml"
    argv = ["calibrate", "--out", str(out), "--size", "32", "--cluster", str(toml)]
    assert main([*argv, "--contention-s", "0"]) == 0  # 0: no cluster brought up for the CPU
    assert Profile.load(out).cluster == ClusterSpec.from_toml(toml)
    assert Profile.load(out).comm_cpu_busy == 0.0
    assert json.loads(out.read_text())["cluster"]["world_size"] == 2


def test_profile_from_another_cluster_is_refused(capsys, tmp_path):
    profile = _recorded(tmp_path, "sim_profile_hybridep_2dc.json", "hybridep_2dc.toml")
    rc, _, err = _simulate(
        capsys,
        "--cluster",
        str(CLUSTERS / "hybridep_4dc.toml"),
        "--model",
        HYBRID_MODEL,
        "--strategy",
        "hybrid",
        "--profile",
        profile,
    )
    assert rc == 2
    assert "'hybridep_2dc' (2 ranks: datacenter 2 x 0.1 Gbit/s 2 ms)" in err
    assert "'hybridep_4dc' (4 ranks: datacenter 4 x 0.25 Gbit/s 2 ms)" in err
    assert "world size 2 vs 4" in err and "datacenter.bandwidth_gbps 0.1 Gbit/s vs 0.25" in err
    assert "--allow-profile-mismatch" in err and len(err.splitlines()) == 1
    # Other level names (2dc2 has a 'rank' level) are named too.
    profile2 = _recorded(tmp_path, "sim_profile_hybridep_2dc2.json", "hybridep_2dc2.toml")
    rc, _, err = _simulate(
        capsys,
        "--cluster",
        str(CLUSTERS / "hybridep_2dc.toml"),
        "--model",
        HYBRID_MODEL,
        "--strategy",
        "dropless",
        "--profile",
        profile2,
    )
    assert rc == 2 and "levels ['datacenter', 'rank'] vs ['datacenter']" in err


def test_profile_mismatch_allowed_names_the_extrapolation(capsys, tmp_path):
    profile = _recorded(tmp_path, "sim_profile_hybridep_2dc.json", "hybridep_2dc.toml")
    rc, out, err = _simulate(
        capsys,
        "--cluster",
        str(CLUSTERS / "hybridep_4dc.toml"),
        "--model",
        HYBRID_MODEL,
        "--strategy",
        "hybrid",
        "--profile",
        profile,
        "--allow-profile-mismatch",
        "--json",
    )
    assert rc == 0 and json.loads(out)["ranks"] == 4
    assert len(err.splitlines()) == 1
    assert "--allow-profile-mismatch: extrapolating" in err and "world size 2 vs 4" in err


def test_profile_of_the_same_cluster_is_silent(capsys, tmp_path):
    profile = _recorded(tmp_path, "sim_profile_hybridep_2dc.json", "hybridep_2dc.toml")
    rc, _, err = _simulate(
        capsys,
        "--cluster",
        str(CLUSTERS / "hybridep_2dc.toml"),
        "--model",
        HYBRID_MODEL,
        "--strategy",
        "hybrid",
        "--profile",
        profile,
    )
    assert rc == 0 and err == ""


def test_old_profile_says_it_records_no_cluster(capsys):
    """The committed profiles predate the record: one line, and the same result as before."""
    profile = str(RESULTS / "sim_profile_hybridep_4dc.json")
    rc, out, err = _simulate(
        capsys,
        "--cluster",
        str(CLUSTERS / "hybridep_2dc.toml"),
        "--model",
        HYBRID_MODEL,
        "--strategy",
        "hybrid",
        "--profile",
        profile,
    )
    assert rc == 0 and "hybrid" in out
    assert err.splitlines() == [
        f"moesaic simulate: --profile {profile} does not record the cluster it was measured on "
        "(written before profiles did); its link and collective figures are applied to "
        "'hybridep_2dc' unchecked"
    ]
    # A compute-only profile (no links, shares or ranks) has nothing to check: no line.
    rc, _, err = _simulate(
        capsys,
        "--cluster",
        FLOWMOE_CLUSTER,
        "--model",
        FLOWMOE_MODEL,
        "--strategy",
        "dropless",
        "--profile",
        str(RESULTS / "sim_profile_h100.json"),
    )
    assert rc == 0 and err == ""


# ------------------------------------------------------------- item 7: --strategy all outputs
def test_strategy_all_writes_every_run_labelled(capsys, tmp_path):
    trace, png, table = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "l.csv"
    rc, _, err = _simulate(
        capsys,
        "--cluster",
        FLOWMOE_CLUSTER,
        "--model",
        FLOWMOE_MODEL,
        "--trace",
        str(trace),
        "--png",
        str(png),
        "--csv",
        str(table),
    )
    assert rc == 0
    rows = list(csv.DictReader(table.open()))
    header = ["strategy", "schedule", "block", "phase", "compute_ms", "comm_ms", "tasks"]
    assert list(rows[0]) == header
    assert list(dict.fromkeys(f"{r['strategy']}+{r['schedule']}" for r in rows)) == RUNS
    events = json.loads(trace.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == dict(enumerate(RUNS))
    names = {
        name: {e["name"] for e in events if e.get("ph") == "X" and e["pid"] == pid}
        for pid, name in procs.items()
    }
    assert all(names.values())  # each process holds its own run's tasks
    assert names["dropless+vanilla"] != names["taskflow+vanilla"]
    assert not png.exists()
    for name in RUNS:
        assert (tmp_path / f"t.{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert err.splitlines() == [
        "moesaic simulate: --png: one chart per run: "
        + ", ".join(str(tmp_path / f"t.{n}.png") for n in RUNS)
    ]


def test_one_run_keeps_its_file_names(capsys, tmp_path):
    png, table = tmp_path / "t.png", tmp_path / "l.csv"
    rc, _, err = _simulate(
        capsys,
        "--cluster",
        FLOWMOE_CLUSTER,
        "--model",
        FLOWMOE_MODEL,
        "--strategy",
        "hybrid",
        "--schedule",
        "flowmoe",
        "--png",
        str(png),
        "--csv",
        str(table),
    )
    assert rc == 0 and err == "" and png.read_bytes()[:4] == b"\x89PNG"
    rows = list(csv.DictReader(table.open()))
    assert {(r["strategy"], r["schedule"]) for r in rows} == {("hybrid", "flowmoe")}


def test_strategy_all_skips_taskflow_on_a_large_world(capsys, tmp_path):
    cluster = tmp_path / "big.toml"
    cluster.write_text(
        'name = "big"\n[[levels]]\nname = "node"\nsize = 512\nbandwidth_gbps = 100.0\n'
        'latency_ms = 0.01\n[[levels]]\nname = "gpu"\nsize = 8\nbandwidth_gbps = 400.0\n'
        "latency_ms = 0.001\n"
    )
    model = tmp_path / "m.toml"
    model.write_text(
        '[model]\nname = "m"\nlayers = 1\nbatch = 4\nseq_len = 16\nhidden = 32\n'
        "ffn_hidden = 64\nexperts = 4096\ntop_k = 1\nheads = 2\nvocab = 64\n"
    )
    rc, out, err = _simulate(capsys, "--cluster", str(cluster), "--model", str(model), "--json")
    assert rc == 0
    assert [r["name"] for r in json.loads(out)] == [n for n in RUNS if n != "taskflow+vanilla"]
    assert err.splitlines() == [
        "moesaic simulate: --strategy all --schedule all: skipping taskflow+vanilla (simulates "
        "worlds of <= 64 ranks, the cluster has 4096)"
    ]


# ------------------------------------------------------------------- item 5: --flops-per-s
@pytest.mark.parametrize("value", ["0", "-1e11", "nan", "inf"])
def test_flops_per_s_must_be_positive_and_finite(capsys, value):
    rc, out, err = _simulate(
        capsys,
        "--cluster",
        FLOWMOE_CLUSTER,
        "--model",
        FLOWMOE_MODEL,
        "--strategy",
        "dropless",
        f"--flops-per-s={value}",
    )
    assert rc == 2 and out == ""
    assert "--flops-per-s" in err and "must be a finite number > 0" in err


def test_flops_per_s_overrides_the_profile(capsys):
    profile = str(RESULTS / "sim_profile_cpu.json")
    base = [
        "--cluster",
        FLOWMOE_CLUSTER,
        "--model",
        FLOWMOE_MODEL,
        "--strategy",
        "dropless",
        "--profile",
        profile,
        "--json",
    ]
    _, out, _ = _simulate(capsys, *base)
    slow = json.loads(out)["compute_ms"]
    rc, out, err = _simulate(capsys, *base, "--flops-per-s", "1e15")
    assert rc == 0 and json.loads(out)["compute_ms"] < slow
    rate = Profile.load(profile).flops_per_s
    assert err.splitlines()[-1].startswith(
        f"moesaic simulate: --flops-per-s 1e+15 overrides the matmul rate of --profile {profile} "
        f"(fp32 {rate:.3g}"
    )
