"""``moesaic bench layer --cluster FILE``: the EP world runs inside the emulated network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moesaic.cli import main
from moesaic.cluster.system import support_problem

PROBLEM = support_problem(probe=True)
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""),
    pytest.mark.timeout(180),
]

SMALL = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "2dc_2node_small.toml"


def test_bench_layer_on_the_emulated_cluster(tmp_path):
    out = tmp_path / "bench.json"
    args = ["bench", "layer", "--cluster", str(SMALL), "--hidden", "16", "--ffn", "16"]
    args += ["--experts", "4", "--tokens", "32", "--iters", "2", "--warmup", "0"]
    assert main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["network"]["levels"][0]["latency_ms"] == 10.0
    rows = result["rows"]
    assert {r["ep"] for r in rows} == {4}
    for r in rows:
        # Collectives per step, each at least the 10 ms between datacenters: the token
        # exchange's 5; hybrid (one domain of the whole world: no token exchange) at least one
        # message per level for all its weight matrices together, over both levels.
        floor = 20.0 if r["impl"] == "hybrid" else 50.0
        assert r["network_bound_ms"] >= floor, r["impl"]
        assert r["step"]["median_ms"] >= r["network_bound_ms"]


def test_ep_sizes_must_match_the_cluster():
    with pytest.raises(ValueError, match=r"must be exactly the cluster's world size \(4\)"):
        from moesaic.bench.layer import LayerBench

        LayerBench(ep_sizes=(1, 2), cluster=str(SMALL))
