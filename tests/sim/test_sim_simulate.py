"""``moesaic.sim.simulate`` and the CLI: HybridEP's domain choice as ``plan_step``'s, the
committed validation table reproduced by ``moesaic simulate``, deterministic output, the JSON
fields, outputs, and clear errors naming the field for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moesaic.cli import main
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.planning.stepmodel import plan_step
from moesaic.sim.collectives import LinkModel
from moesaic.sim.hybrid import moe_config, plan_domains_fast
from moesaic.sim.model import ModelSpec
from moesaic.sim.profile import Profile
from moesaic.sim.runs import legacy_run, runs
from moesaic.sim.simulate import SimOptions, simulate

ROOT = Path(__file__).resolve().parents[2]
FLOWMOE_CLUSTER = str(ROOT / "examples/clusters/flowmoe_2rank.toml")
FLOWMOE_MODEL = str(ROOT / "examples/models/flowmoe_small.toml")
# uniform routing: the committed tables were predicted with it
BASE = ("--cluster", FLOWMOE_CLUSTER, "--model", FLOWMOE_MODEL, "--routing", "uniform")
FIELDS = ("iteration_ms", "compute_ms", "comm_ms", "exposed_comm_ms", "bound_ms", "ranks", "wall_s")


def _cli_json(capsys, *args: str):
    assert main(["simulate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("levels", "T", "F", "flops"),
    [
        (((2, 0.1, 2.0),), 2048, 128, 1e11),  # big traffic, small experts: gather
        (((2, 0.1, 2.0),), 256, 1024, 1e11),  # wide experts: classic EP
        (((2, 0.1, 2.0), (2, 1.0, 0.1)), 1024, 128, 3e10),
        (((4, 0.25, 2.0),), 512, 256, 9e10),
        (((2, 0.05, 5.0), (4, 10.0, 0.05)), 4096, 64, 1e12),
    ],
)
def test_hybrid_domains_are_plan_steps(levels, T, F, flops):
    spec = ClusterSpec(
        levels=tuple(
            Level(name=f"l{i}", size=s, bandwidth_gbps=b, latency_ms=a)
            for i, (s, b, a) in enumerate(levels)
        )
    )
    model = ModelSpec(
        layers=2,
        batch=T // 256 or 1,
        seq_len=min(T, 256),
        hidden=256,
        ffn_hidden=F,
        experts=8,
        top_k=2,
    )
    chosen, _ = plan_domains_fast(LinkModel(spec=spec), model, flops)
    ref = plan_step(
        spec,
        moe_config(model),
        tokens_per_rank=model.tokens,
        flops_per_s=flops,
        blocks=2,
        seq_len=model.seq_len,
    )
    assert chosen.domain_sizes == ref.chosen.domain_sizes
    assert 2 * chosen.step_s == pytest.approx(ref.chosen.step_s)


@pytest.mark.parametrize(
    ("cr", "every", "prefetch", "shared"),
    [
        (1.0, 1, True, "domain"),
        (16.0, 4, True, "domain"),
        (50.0, 1, False, "domain"),
        (16.0, 2, True, "all"),
        (16.0, 1, False, "none"),
    ],
)
def test_hybrid_parts_equal_predict_step_with_migration(cr, every, prefetch, shared):
    """+Migration (SR compression, shared experts' all-reduce over the groups ``shared`` names,
    prefetched gathers): every domain tuple's step equals predict_step's, and the chosen
    domains are plan_step's."""
    from moesaic.planning.stepmodel import predict_step
    from moesaic.sim.hybrid import hybrid_parts
    from moesaic.sim.hybrid_costmodel import domain_size_choices

    spec = ClusterSpec(
        levels=(
            Level(name="dc", size=2, bandwidth_gbps=0.1, latency_ms=2.0),
            Level(name="r", size=4, bandwidth_gbps=1.0, latency_ms=0.1),
        )
    )
    model = ModelSpec(
        layers=2, batch=4, seq_len=256, hidden=256, ffn_hidden=512, experts=8, top_k=2
    )
    kw = dict(
        compression_ratio=cr, shared_expert_every=every, prefetch=prefetch, shared_expert=shared
    )
    common = dict(tokens_per_rank=model.tokens, flops_per_s=3e10, blocks=2, seq_len=256)
    for ds in domain_size_choices(spec):
        ref = predict_step(spec, moe_config(model), ds, **common, **kw)
        got = hybrid_parts(LinkModel(spec=spec), model, ds, 3e10, **kw)
        assert 2 * got.step_s == pytest.approx(ref.step_s), ds
    chosen, _ = plan_domains_fast(LinkModel(spec=spec), model, 3e10, **kw)
    ref_plan = plan_step(spec, moe_config(model), **common, **kw)
    assert chosen.domain_sizes == ref_plan.chosen.domain_sizes


def test_shared_expert_scope_prices_the_groups_the_runtime_all_reduces_over():
    """``shared_expert`` "all" adds the offset group's all-reduce (one rank per domain) to
    "domain"'s, a reduce-scatter and an all-gather of 1/n of a dense expert on each of its
    levels; "none" has no all-reduce; a domain of the whole group has no offset group, so "all"
    equals "domain" there."""
    from moesaic.sim.collectives import level_exchange_s
    from moesaic.sim.hybrid import hybrid_parts

    spec = ClusterSpec(
        levels=(
            Level(name="dc", size=2, bandwidth_gbps=0.1, latency_ms=2.0),
            Level(name="r", size=4, bandwidth_gbps=1.0, latency_ms=0.1),
        )
    )
    link = LinkModel(spec=spec)
    model = ModelSpec(
        layers=2, batch=4, seq_len=256, hidden=256, ffn_hidden=512, experts=8, top_k=2
    )

    def gather(ds, shared):
        return hybrid_parts(link, model, ds, 3e10, compression_ratio=16.0, shared_expert=shared)

    one_expert = 256 * 512 * 3 * 4  # w1, w3, w2 in fp32
    for ds, offset in (((1, 4), 2), ((1, 2), 4)):  # offset group: 2 ranks over dc; 2 x 2
        none, domain, every = (gather(ds, s).gather for s in ("none", "domain", "all"))
        assert none < domain < every
        if offset == 2:  # one level: the dc link, 1 peer, 2 * expert / 2 bytes
            want = level_exchange_s(link, 0, 1, 2 * one_expert / 2, gather=True)
            assert every - domain == pytest.approx(want)
    whole = (2, 4)
    assert gather(whole, "all").gather == gather(whole, "domain").gather


def _new_spelling(row: dict, levels: int) -> tuple[str, str, dict]:
    """A row's run as strategy, schedule and the options an old mixed name fixed (the table
    was written with the old names; a row with a ``schedule`` has the new ones)."""
    if "schedule" in row:
        return row["strategy"], row["schedule"], {}
    legacy = legacy_run(row["strategy"], levels)
    if legacy is None:
        return row["strategy"], "vanilla", {}
    (strategy, schedule), domains = legacy
    return strategy, schedule, {} if domains is None else {"domain_sizes": domains}


def test_committed_validation_table_is_what_simulate_predicts(capsys, tmp_path):
    """Every FlowMoE row of benchmarks/results/sim_validation.json (measured calibration and
    fitted share), re-simulated by ``moesaic simulate`` with the row's profile, gives the
    committed prediction; so does every HybridEP and taskflow-cluster row through ``simulate``
    (the table's old mixed names given as strategy and schedule)."""
    table = json.loads((ROOT / "benchmarks/results/sim_validation.json").read_text())
    rows = table["rows"] + table["rows_fitted"]
    assert any(r["profile"]["collectives"] for r in table["rows"])
    sources = {r["source"] for r in rows}
    assert sources >= {"flowmoe_cluster.json", "hybridep_2dc.json", "taskflow_cluster.json"}
    for i, row in enumerate(rows):
        if row["source"] == "flowmoe_cluster.json":
            prof = tmp_path / f"p{i}.json"
            Profile.from_dict(row["profile"]).save(prof)
            strategy, schedule, _ = _new_spelling(row, 1)
            args = [*BASE, "--profile", str(prof), "--strategy", strategy, "--schedule", schedule]
            args += ["--degree", str(row["degree"])]
            if "sp_bytes" in row:
                args += ["--sp-bytes", repr(row["sp_bytes"])]
            got = _cli_json(capsys, *args)["iteration_ms"]
        else:
            if row["source"].startswith("taskflow_cluster"):
                spec = ClusterSpec.from_dict(row["cluster_spec"])
                options = row["options"]
            else:
                name = row["source"].removesuffix(".json")
                spec = ClusterSpec.from_toml(ROOT / f"examples/clusters/{name}.toml")
                options = {"domain_sizes": tuple(row["domain_sizes"]), **row.get("options", {})}
            strategy, schedule, fixed = _new_spelling(row, spec.num_levels)
            if row["source"].startswith("hybridep") and strategy == "hybrid":
                fixed = {**fixed, "hybrid_step": "benchmark"}  # what that benchmark measures
            opts = SimOptions(**{**options, **fixed})
            model, profile = ModelSpec(**row["model"]), Profile.from_dict(row["profile"])
            sim = simulate(spec, model, strategy, profile, opts, schedule=schedule)
            got = sim.iteration_s * 1e3
        assert got == pytest.approx(row["simulated_ms"], rel=1e-9), row["point"]


def test_deterministic_output(capsys, tmp_path):
    """Two runs: the same summary (but the wall time) and the same trace, byte for byte."""
    outs = []
    for k in range(2):
        trace = tmp_path / f"t{k}.json"
        rows = _cli_json(capsys, *BASE, "--strategy", "all", "--trace", str(trace))
        summaries = [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]
        outs.append((summaries, trace.read_bytes()))
    assert outs[0] == outs[1]


def test_json_fields_and_one_row_per_run(capsys):
    rows = _cli_json(capsys, *BASE)
    assert [r["name"] for r in rows] == [r.name for r in runs("all", "all")]
    assert [(r["strategy"], r["schedule"]) for r in rows] == list(runs("all", "all"))
    for r in rows:
        assert all(f in r for f in FIELDS)
        assert r["ranks"] == 2
        # the iteration is at least the perfect-overlap bound and at most compute + comm
        assert r["bound_ms"] <= r["iteration_ms"] + 1e-9
        assert r["iteration_ms"] <= r["compute_ms"] + r["comm_ms"] + 1e-9
        assert 0 <= r["exposed_comm_ms"] <= r["comm_ms"] + 1e-9
    one = _cli_json(capsys, *BASE, "--strategy", "dropless", "--schedule", "flowmoe")
    assert isinstance(one, dict) and (one["strategy"], one["schedule"]) == ("dropless", "flowmoe")
    by = {r["name"]: r for r in rows}
    assert by["dropless+flowmoe"]["iteration_ms"] < by["dropless+vanilla"]["iteration_ms"]
    assert by["hybrid+flowmoe"]["iteration_ms"] < by["hybrid+moe-only"]["iteration_ms"]


def test_trace_png_and_layer_csv(capsys, tmp_path):
    trace, png, csv = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "l.csv"
    common = ["simulate", *BASE]
    outputs = ["--trace", str(trace), "--png", str(png), "--csv", str(csv)]
    main([*common, "--strategy", "dropless", "--schedule", "flowmoe", *outputs])
    out = capsys.readouterr().out
    assert "dropless  flowmoe" in out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"AT1.1", "D1.1", "E1.1", "C1.1", "head1", "AR1", "optimizer"} <= names
    assert png.read_bytes()[:4] == b"\x89PNG"
    lines = csv.read_text().splitlines()
    assert lines[0] == "strategy,schedule,block,phase,compute_ms,comm_ms,tasks"
    assert any(line.startswith("dropless,flowmoe,4,bwd,") for line in lines)


def test_skew_slows_the_busiest_rank():
    spec = ClusterSpec.from_toml(FLOWMOE_CLUSTER)
    base = ModelSpec.from_toml(FLOWMOE_MODEL)
    prof = Profile(flops_per_s=1e11)
    flat = simulate(spec, base, "dropless", prof).iteration_s
    import dataclasses

    skewed = dataclasses.replace(base, routing_skew=1.5)
    assert simulate(spec, skewed, "dropless", prof).iteration_s > flat
    capped = dataclasses.replace(skewed, capacity_factor=1.0)
    assert simulate(spec, capped, "dropless", prof).iteration_s < flat


BAD_MODELS = [
    ("[model]\nlayers = 2\n", "missing field"),
    (
        "[model]\nlayers = 0\nbatch = 1\nseq_len = 8\nhidden = 8\nffn_hidden = 8\nexperts = 2\n"
        "top_k = 1\n",
        "model.layers",
    ),
    (
        "[model]\nlayers = 1\nbatch = 1\nseq_len = 8\nhidden = 8\nffn_hidden = 8\nexperts = 2\n"
        "top_k = 3\n",
        "model.top_k",
    ),
    (
        "[model]\nlayers = 1\nbatch = 1\nseq_len = 8\nhidden = 8\nffn_hidden = 8\nexperts = 2\n"
        "top_k = 1\nroutng_skew = 1\n",
        "routng_skew",
    ),
    (
        "[model]\nlayers = 1\nbatch = 1\nseq_len = 8\nhidden = 8\nffn_hidden = 8\nexperts = 2\n"
        "top_k = 1\nactivation = 'relu'\n",
        "model.activation",
    ),
    (
        "[model]\nlayers = 1\nbatch = 1\nseq_len = 8\nhidden = 8\nffn_hidden = 8\nexperts = 3\n"
        "top_k = 1\n",
        "model.experts",
    ),  # 3 experts on 2 ranks
    ("layers = [\n", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "field"), BAD_MODELS)
def test_bad_model_file_names_the_field(capsys, tmp_path, text, field):
    path = tmp_path / "m.toml"
    path.write_text(text)
    assert main(["simulate", "--cluster", FLOWMOE_CLUSTER, "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert field in err and "error" in err


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (
            "[[levels]]\nname = 'a'\nsize = 2\nbandwidth_gbps = -1\nlatency_ms = 1\n",
            "levels[0].bandwidth_gbps",
        ),
        ("[[levels]]\nname = 'a'\nsize = 2\nlatency_ms = 1\n", "missing field"),
        ("levels = []\n", "levels"),
    ],
)
def test_bad_cluster_file_names_the_field(capsys, tmp_path, text, field):
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert main(["simulate", "--cluster", str(path), "--model", FLOWMOE_MODEL]) == 2
    err = capsys.readouterr().err
    assert "--cluster" in err and field in err


def test_bad_options_are_clear_errors(capsys):
    common = ["simulate", *BASE]
    assert main([*common, "--strategy", "nope"]) == 2
    assert "strategy" in capsys.readouterr().err
    assert main([*common, "--degree", "3"]) == 2  # 3 does not divide the batch of 8
    assert "degree" in capsys.readouterr().err
    assert main([*common, "--strategy", "hybrid", "--domains", "3"]) == 2
    assert "domain_sizes" in capsys.readouterr().err


def test_calibrate_writes_a_profile(capsys, tmp_path):
    out = tmp_path / "p.json"
    check = ROOT / "benchmarks/results/cluster_check.json"
    assert main(["calibrate", "--out", str(out), "--size", "64", "--links", str(check)]) == 0
    assert json.loads(capsys.readouterr().out)["source"].startswith("measured")
    prof = Profile.load(out)
    assert prof.flops_per_s > 1e6 and prof.task_overhead_s > 0
    assert 0 < prof.floor_s < 1e-2 and 0.5 < prof.bandwidth_scale <= 1.5
    rows = _cli_json(capsys, *BASE, "--profile", str(out), "--strategy", "dropless")
    assert rows["iteration_ms"] > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"flops_per_s": -1}')
    assert main(["simulate", *BASE, "--profile", str(bad)]) == 2
    assert "profile.flops_per_s" in capsys.readouterr().err


def test_simulate_is_torch_free():
    """``moesaic simulate`` (every strategy, taskflow's compiler included) never imports torch:
    a simulation costs no 3-4 s torch import on a 2-core machine."""
    import subprocess
    import sys

    code = (
        "import sys; from moesaic.cli import main; "
        f"main(['simulate', '--cluster', {FLOWMOE_CLUSTER!r}, '--model', {FLOWMOE_MODEL!r}, "
        "'--json']); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
