"""``moesaic plan``: the ranking of every runnable combination (the table, and ``--json`` equal
to ``plan_runs``; the 1,000-DC example is tests/planning/test_planner.py's) and
``--domains-only``, HybridEP's domain sizes (every candidate in the table, ``--json`` equal to
``plan_domains``, the inputs derived from the training TOML); torch-free with a given rate,
one-line errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moesaic.cli import main
from moesaic.cluster.spec import ClusterSpec
from moesaic.config import MoEConfig
from moesaic.sim.hybrid_costmodel import plan_domains, stream_inputs

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "examples" / "clusters"
TINY = ROOT / "examples" / "train_tiny.toml"  # H 64, F 128, E 4, K 2, batch 8 x seq 64
SMALL = CLUSTERS / "2dc_2node_small.toml"  # 2 x 2 ranks
DEEP = CLUSTERS / "2dc_2node_2gpu_small.toml"  # 2 x 2 x 2 ranks


def _model(tmp_path: Path, **moe: object) -> Path:
    """A training TOML (like examples/train_tiny.toml) with the given [model.moe] keys."""
    lines = ["batch_size = 4", "[model]", "seq_len = 32", "d_model = 64", "n_layers = 3"]
    lines += ["n_heads = 2", "dense_layers = 1", "[model.moe]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in moe.items()]
    path = tmp_path / "model.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _plan(capsys, *argv: str) -> str:
    """``moesaic plan --domains-only`` (HybridEP's domain sizes alone)."""
    assert main(["plan", "--domains-only", *argv]) == 0
    return capsys.readouterr().out


def _expected(cluster: Path, moe: MoEConfig, *, tokens: int, flops: float, seq: int, **kw):
    """plan_domains on inputs built here from the documented rules (fp32, dense width 4 H)."""
    spec = ClusterSpec.from_toml(cluster)
    inputs = stream_inputs(
        moe,
        tokens_per_rank=tokens,
        ep_size=spec.world_size,
        flops_per_s=flops,
        act_bytes=4,
        param_bytes=4,
        seq_len=seq,
        dense_ffn_hidden_size=4 * moe.hidden_size,
        **kw,
    )
    return plan_domains(spec, inputs), inputs


# (cluster, extra flags, [model.moe] keys, expected kwargs of stream_inputs): the tiny example
# on 2 x 2 ranks; 8 experts on 2 x 2 x 2 ranks (8 candidates) with compression; a big-expert
# model whose experts cost more to move than the tokens (classic EP wins).
CASES = [
    (SMALL, ["--model", str(TINY)], None, {"tokens": 512, "seq": 64}),
    (
        DEEP,
        ["--compression-ratio", "20"],
        {"num_experts": 8, "top_k": 2, "ffn_hidden_size": 128},
        {"tokens": 128, "seq": 32, "compression_ratio": 20.0},
    ),
    (
        SMALL,
        ["--tokens-per-rank", "8"],
        {"num_experts": 4, "top_k": 1, "ffn_hidden_size": 4096},
        {"tokens": 8, "seq": 32},
    ),
]


@pytest.mark.parametrize("cluster, flags, moe, expect", CASES, ids=["tiny", "deep-cr", "classic"])
def test_json_equals_plan_domains(cluster, flags, moe, expect, tmp_path, capsys):
    flops = 2e10
    args = ["--cluster", str(cluster), "--flops-per-s", str(flops), "--json", *flags]
    if moe is not None:
        args += ["--model", str(_model(tmp_path, **moe))]
        # n_layers 3, dense_layers 1: two MoE blocks, the priced one has no dense block before
        config = MoEConfig(hidden_size=64, **moe)
    else:
        config = MoEConfig(hidden_size=64, ffn_hidden_size=128, num_experts=4, top_k=2)
    out = json.loads(_plan(capsys, *args))
    plan, inputs = _expected(cluster, config, flops=flops, **expect)
    assert out["chosen"]["domain_sizes"] == list(plan.chosen.domain_sizes)
    assert out["chosen"]["p"] == list(plan.chosen.p)
    assert out["chosen"]["predicted_s"] == pytest.approx(plan.chosen.final_s, rel=1e-12)
    assert out["reason"] == plan.reason
    assert out["inputs"]["data_bytes"] == inputs.data_bytes
    assert out["inputs"]["expert_bytes"] == inputs.expert_bytes
    assert out["inputs"]["pre_expert_s"] == pytest.approx(inputs.pre_expert_s, rel=1e-12)
    assert out["flops_measured"] is False and out["flops_per_s"] == flops
    got = {tuple(c["domain_sizes"]): c for c in out["candidates"]}
    assert len(got) == len(out["candidates"]) == len(plan.candidates)
    for c in plan.candidates:
        row = got[c.domain_sizes]
        assert row["ag_s"] == pytest.approx(list(c.ag_s), rel=1e-12)
        assert row["a2a_s"] == pytest.approx(list(c.a2a_s), rel=1e-12)
        assert row["speedup_vs_classic"] == pytest.approx(plan.classic.final_s / c.final_s)
        assert row["chosen"] == (c is plan.chosen)


def test_the_cases_cover_both_answers(tmp_path, capsys):
    """The cases above are not all one answer: hybrid wins in one, classic EP in another."""
    chosen = []
    for cluster, flags, moe, _ in CASES:
        model = str(TINY) if moe is None else str(_model(tmp_path, **moe))
        argv = ["--cluster", str(cluster), "--model", model, "--flops-per-s", "2e10", "--json"]
        chosen.append(json.loads(_plan(capsys, *argv, *flags))["chosen"]["domain_sizes"])
    assert chosen[0] != [1, 1] and chosen[2] == [1, 1]


def test_table_lists_every_candidate(capsys):
    argv = ["--cluster", str(SMALL), "--model", str(TINY), "--flops-per-s", "2e10"]
    text = _plan(capsys, *argv)
    data = json.loads(_plan(capsys, *argv, "--json"))
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["domains", "p"])
    rows = lines[head + 1 : head + 1 + len(data["candidates"])]
    for row, cand in zip(rows, data["candidates"]):
        starred = row.startswith("*")
        cells = row.lstrip("*").split("  ")
        cells = [c.strip() for c in cells if c.strip()]
        assert cells[0] == str(cand["domain_sizes"]) and starred == cand["chosen"]
        assert cells[-2] == f"{cand['predicted_s']:.3g}"
        assert cells[-1] == f"{cand['speedup_vs_classic']:.2f}x"
    assert sum(row.startswith("*") for row in rows) == 1
    assert lines[head + 1 + len(rows)].startswith("(AG s and A2A s per level")
    assert f"reason   {data['reason']}" in lines
    assert f"chosen   domains {data['chosen']['domain_sizes']}" in text


def test_dense_blocks_before_the_only_moe_block_count(tmp_path, capsys):
    """One MoE block after a dense one: Eq. 2's m = 1 (its FFN and attention are pre-expert)."""
    model = _model(tmp_path, num_experts=4)
    text = model.read_text().replace("n_layers = 3", "n_layers = 2")
    model.write_text(text)
    argv = ["--cluster", str(SMALL), "--model", str(model), "--flops-per-s", "1e9", "--json"]
    out = json.loads(_plan(capsys, *argv))
    config = MoEConfig(hidden_size=64, ffn_hidden_size=256, num_experts=4)
    _, inputs = _expected(SMALL, config, tokens=128, flops=1e9, seq=32, dense_blocks_before=1)
    assert out["model"]["dense_blocks_before"] == 1
    assert out["inputs"]["pre_expert_s"] == pytest.approx(inputs.pre_expert_s, rel=1e-12)


def test_pipeline_degree_divides_the_tokens(tmp_path, capsys):
    model = _model(tmp_path, num_experts=4)
    model.write_text('schedule = "moe-only"\npipeline_degree = 2\n' + model.read_text())
    argv = ["--cluster", str(SMALL), "--model", str(model), "--flops-per-s", "1e9", "--json"]
    assert json.loads(_plan(capsys, *argv))["model"]["tokens_per_rank"] == 4 * 32 // 2


def test_measures_the_rate_when_not_given(capsys):
    out = json.loads(_plan(capsys, "--cluster", str(SMALL), "--model", str(TINY), "--json"))
    assert out["flops_measured"] is True and out["flops_per_s"] > 1e6


_PROBE = """
import json, sys
from moesaic.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


@pytest.mark.parametrize("mode", [[], ["--domains-only"]], ids=["ranking", "domains-only"])
def test_plan_with_a_given_rate_does_not_import_torch(mode):
    argv = ["plan", "--cluster", str(SMALL), "--model", str(TINY), "--flops-per-s", "1e10", *mode]
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"code": 0, "torch": False}


def _bad_cluster(tmp_path: Path) -> Path:
    text = SMALL.read_text().replace("bandwidth_gbps = 0.1 ", "bandwidth_gbps = 0 ")
    path = tmp_path / "bad_cluster.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "make_argv, words",
    [
        # missing files: the option and the path
        (lambda t: ["--cluster", str(t / "nope.toml"), "--model", str(TINY)], ["--cluster"]),
        (lambda t: ["--cluster", str(SMALL), "--model", str(t / "nope.toml")], ["--model"]),
        # a level with zero bandwidth: the field
        (
            lambda t: ["--cluster", str(_bad_cluster(t)), "--model", str(TINY)],
            ["--cluster", "levels[0].bandwidth_gbps"],
        ),
        # 8 ranks cannot share 4 experts
        (
            lambda t: ["--cluster", str(DEEP), "--model", str(TINY)],
            ["num_experts (4)", "world size (8)"],
        ),
        # a model TOML with an unknown key, and one that is not TOML
        (
            lambda t: ["--cluster", str(SMALL), "--model", str(_model(t, experts=4))],
            ["--model", "'experts'"],
        ),
        (
            lambda t: ["--cluster", str(SMALL), "--model", str(_write(t, "x = [1,"))],
            ["--model", "not valid TOML"],
        ),
        (
            lambda t: ["--cluster", str(SMALL), "--model", str(TINY), "--flops-per-s", "0"],
            ["flops_per_s"],
        ),
        (
            lambda t: ["--cluster", str(SMALL), "--model", str(TINY), "--tokens-per-rank", "0"],
            ["tokens_per_rank"],
        ),
        (
            lambda t: ["--cluster", str(SMALL), "--model", str(TINY), "--compression-ratio", "0.5"],
            ["compression_ratio (--compression-ratio) (0.5)", "[1, 1e+06]"],
        ),
    ],
    ids=[
        "no-cluster",
        "no-model",
        "zero-bandwidth",
        "experts",
        "unknown-key",
        "bad-toml",
        "flops",
        "tokens",
        "cr",
    ],
)
def test_errors_are_one_line_naming_the_field(make_argv, words, tmp_path, capsys):
    argv = make_argv(tmp_path)
    if "--flops-per-s" not in argv:
        argv += ["--flops-per-s", "1e10"]
    assert main(["plan", "--domains-only", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moesaic plan: error: ") and "\n" not in err, err
    for word in words:
        assert word in err, err


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "broken.toml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------ the ranking (default mode)


# 2 x 2 ranks, the tiny example's model: every strategy runs there, and fast to simulate
SMALL_TINY = ["--cluster", str(SMALL), "--model", str(TINY)]


def _rank(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_json_is_plan_runs_and_the_table_its_head(capsys):
    """``--json`` lists every combination of ``plan_runs`` in its order with the documented
    keys; the table shows the first ``--top`` of them, the pick and the same reason."""
    from moesaic.planning.planner import plan_runs
    from moesaic.sim.prior import RoutingPrior
    from moesaic.sim.profile import Profile
    from moesaic.train.model_files import load_model_spec

    rows = json.loads(_rank(capsys, *SMALL_TINY, "--flops-per-s", "2e10", "--json"))
    spec = ClusterSpec.from_toml(SMALL)
    model = load_model_spec(TINY)  # no routing given: the prior's 50th percentile
    prior = RoutingPrior.of(
        model.experts, model.top_k, model.tokens * spec.world_size, model.hidden
    )
    model = dataclasses.replace(model, measured_loads=prior.rows(1))
    plan = plan_runs(spec, model, Profile(flops_per_s=2e10), routing_prior=prior)
    assert [r["rank"] for r in rows] == list(range(1, len(plan.ranked) + 1))
    for row, c in zip(rows, plan.ranked, strict=True):
        assert {"strategy", "schedule", "options", "predicted_ms", "bound_ms"} <= set(row)
        assert (row["strategy"], row["schedule"], row["options"]) == (
            c.strategy,
            c.schedule,
            c.options,
        )
        assert row["predicted_ms"] == pytest.approx(c.predicted_ms, rel=1e-12)
        assert row["range_ms"] == pytest.approx(list(c.range_ms), rel=1e-12)
        assert row["tie"] == c.tie
    assert rows[0]["reason"] == plan.reason and "reason" not in rows[1]
    text = _rank(capsys, *SMALL_TINY, "--flops-per-s", "2e10", "--top", "3")
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["#", "strategy", "schedule"]
    for i, (line, c) in enumerate(zip(lines[1:4], plan.ranked[:3], strict=True)):
        cells = line.split()
        assert cells[:3] == [str(i + 1), c.strategy, c.schedule]
        assert f"{c.predicted_ms:.4g}" in cells and f"{c.bound_ms:.4g}" in cells
    assert lines[4] == f"... {len(plan.ranked) - 3} more (--top N, or --json for every one)"
    assert f"pick     {plan.chosen.name} {plan.chosen.knobs()}" in lines
    assert f"reason   {plan.reason}" in lines


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--top", "0"], ["top (--top)"]),
        (["--tokens-per-rank", "8"], ["--tokens-per-rank", "--domains-only"]),
        (["--compression-ratio", "4,x"], ["compression_ratio", "comma-separated"]),
        (
            ["--compression-ratio", "1,0.5"],
            ["compression_ratio (--compression-ratio) (0.5)", "[1,"],
        ),
        (["--flops-per-s", "-1"], ["flops_per_s"]),
    ],
    ids=["top", "domains-only-flag", "cr-text", "cr-small", "flops"],
)
def test_ranking_errors_name_the_flag(extra, words, capsys):
    argv = [*SMALL_TINY, *extra]
    if "--flops-per-s" not in argv:
        argv += ["--flops-per-s", "1e10"]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moesaic plan: error: ") and "\n" not in err, err
    for word in words:
        assert word in err, err


def test_measure_routing_prices_the_jobs_own_loads(data_file, tmp_path, capsys):
    """``--measure-routing`` runs the job's router on its data first (``train.routing_run``) and
    the ranking prices those loads (the note says so); with --loads it is refused, and a model
    file (no data) keeps uniform routing with a note."""
    job = tmp_path / "job.toml"
    job.write_text(
        f'batch_size = 2\nsteps = 3\ndata = "{data_file}"\n[model]\nseq_len = 32\n'
        "d_model = 32\nn_layers = 2\nn_heads = 2\n[model.moe]\nnum_experts = 4\ntop_k = 2\n"
        "ffn_hidden_size = 32\n"
    )
    base = ["plan", "--cluster", str(SMALL), "--flops-per-s", "1e10", "--json"]
    assert main([*base, "--model", str(job), "--measure-routing"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)[0]["rank"] == 1
    assert "routing from the profile (job.toml's router on its data" in out.err
    assert main([*base, "--model", str(job), "--measure-routing", "--loads", str(job)]) == 2
    assert "--measure-routing and --loads" in capsys.readouterr().err
    spec = tmp_path / "m.toml"
    spec.write_text(
        '[model]\nname = "m"\nlayers = 2\nbatch = 2\nseq_len = 32\nhidden = 32\n'
        "ffn_hidden = 32\nexperts = 4\ntop_k = 2\n"
    )
    assert main([*base, "--model", str(spec), "--measure-routing"]) == 0
    assert "is a model file (no data): routing from the prior" in capsys.readouterr().err
    assert main([*base, "--model", str(job), "--measure-routing", "--domains-only"]) == 2
    assert "--measure-routing applies to the ranking" in capsys.readouterr().err


def test_capacity_factor_adds_entries_that_train_accepts(capsys, tmp_path):
    """``--capacity-factor`` ranks every combination again at that capacity; the entries carry
    the option; bad values name the flag and the rule."""
    rows = json.loads(
        _rank(capsys, *SMALL_TINY, "--flops-per-s", "2e10", "--json", "--capacity-factor", "1.25")
    )
    capped = [r for r in rows if r["options"].get("capacity_factor") == 1.25]
    assert capped and len(capped) * 2 == len(rows)
    for bad, words in (("x", "must be numbers"), ("0", "(0.0) must be a finite number in (0,")):
        assert main(["plan", *SMALL_TINY, "--flops-per-s", "2e10", "--capacity-factor", bad]) == 2
        err = capsys.readouterr().err
        assert "--capacity-factor" in err and words in err, err


def test_ep_adds_replica_entries_and_bad_values_are_refused(capsys):
    """``--ep auto`` ranks EP groups below the world too (replicas of the unsharded model): on
    2 DCs x 2 ranks and 4 experts it tries EP 1 and 2, both priced (EP 1's 4 replicas span
    both levels: gloo's ring over them); a size that does not divide the world, and
    ``--domains-only``, are refused naming the flag."""
    assert main(["plan", *SMALL_TINY, "--flops-per-s", "2e10", "--json", "--ep", "auto"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert {r["options"]["ep"] for r in rows if "ep" in r["options"]} == {1, 2}
    assert "must span one level" not in captured.err
    assert any("ep" not in r["options"] for r in rows)  # EP = the world stays
    assert main(["plan", *SMALL_TINY, "--flops-per-s", "2e10", "--ep", "3"]) == 2
    assert "ep_sizes[0] (3) must be below the world size (4)" in capsys.readouterr().err
    assert main(["plan", *SMALL_TINY, "--flops-per-s", "2e10", "--ep", "two"]) == 2
    assert "ep (--ep) must be 'auto' or a comma list" in capsys.readouterr().err
    assert main(["plan", *SMALL_TINY, "--domains-only", "--ep", "2"]) == 2
    assert "--ep applies to the ranking" in capsys.readouterr().err
