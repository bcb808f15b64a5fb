"""ClusterSpec parsing and validation, the network plan and the measurement plan (no root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.cluster.topology import NAMESPACE_RE, build_topology, rank_address, tbf_args
from moesaic.cluster.verify import measurement_plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"

TWO_BY_TWO = """
name = "t"
world_size = 4
[[levels]]
name = "dc"
size = 2
bandwidth_gbps = 1
latency_ms = 5.0
[[levels]]
name = "node"
size = 2
bandwidth_gbps = 10.0
latency_ms = 0.1
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def _spec(*sizes: int, bw=None, lat=None) -> ClusterSpec:
    bw = bw or [1.0] * len(sizes)
    lat = lat or [1.0] * len(sizes)
    return ClusterSpec(
        levels=tuple(
            Level(name=f"l{i}", size=s, bandwidth_gbps=b, latency_ms=t)
            for i, (s, b, t) in enumerate(zip(sizes, bw, lat))
        )
    )


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_checked_in_examples_parse(path: Path) -> None:
    spec = ClusterSpec.from_toml(path)
    assert spec.world_size >= 2
    assert ClusterSpec.from_dict(spec.to_dict()) == spec


def test_two_by_two_geometry(tmp_path: Path) -> None:
    spec = ClusterSpec.from_toml(_write(tmp_path, TWO_BY_TWO))
    assert spec.world_size == 4 and spec.name == "t"
    assert [spec.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert spec.separating_level(0, 1) == 1  # same datacenter, other node
    assert spec.separating_level(1, 2) == 0  # other datacenter
    assert spec.path(3, 0).bandwidth_gbps == 1.0 and spec.path(3, 0).latency_ms == 5.0
    assert spec.path(2, 3).level_name == "node" and spec.path(2, 3).latency_ms == 0.1
    assert spec.representative_pairs() == {0: (0, 2), 1: (0, 1)}
    assert spec.num_groups(0) == 2 and spec.ranks_per_group(0) == 2 and spec.group_of(3, 0) == 1


def test_path_bandwidth_is_the_slowest_crossed_level() -> None:
    # An inner level slower than the outer one (a thin NIC) bottlenecks every path through it.
    spec = _spec(2, 2, bw=[10.0, 1.0])
    assert spec.path(0, 2).bandwidth_gbps == 1.0
    assert spec.path(0, 1).bandwidth_gbps == 1.0


def test_size_one_level_separates_nobody() -> None:
    spec = _spec(2, 1, 2)  # 2 dc x 1 node x 2 gpus
    assert spec.world_size == 4
    assert set(spec.representative_pairs()) == {0, 2}
    assert spec.separating_level(0, 1) == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # stated world size disagrees with the product of sizes
        (TWO_BY_TWO.replace("world_size = 4", "world_size = 8"), "world_size (8) must equal"),
        # zero bandwidth
        (
            TWO_BY_TWO.replace("bandwidth_gbps = 1\n", "bandwidth_gbps = 0\n"),
            "levels[0].bandwidth_gbps (0)",
        ),
        # negative bandwidth
        (
            TWO_BY_TWO.replace("bandwidth_gbps = 10.0", "bandwidth_gbps = -1.0"),
            "levels[1].bandwidth_gbps (-1.0) must be a finite number in [1e-06, 100000]",
        ),
        # negative latency
        (
            TWO_BY_TWO.replace("latency_ms = 0.1", "latency_ms = -0.1"),
            "levels[1].latency_ms (-0.1) must be a finite number in [0, 10000]",
        ),
        # infinite latency
        (TWO_BY_TWO.replace("latency_ms = 0.1", "latency_ms = inf"), "levels[1].latency_ms (inf)"),
        # size zero
        (
            TWO_BY_TWO.replace(
                "size = 2\nbandwidth_gbps = 10.0", "size = 0\nbandwidth_gbps = 10.0"
            ),
            "levels[1].size (0) must be >= 1",
        ),
        # fractional size
        (
            TWO_BY_TWO.replace(
                "size = 2\nbandwidth_gbps = 1\n", "size = 1.5\nbandwidth_gbps = 1\n"
            ),
            "levels[0].size must be an int, got float (1.5)",
        ),
        # missing field
        (
            TWO_BY_TWO.replace("latency_ms = 5.0\n", ""),
            "levels[0]: missing field(s) ['latency_ms']",
        ),
        # unknown field in a level
        (
            TWO_BY_TWO.replace("latency_ms = 5.0\n", "latency_ms = 5.0\nlatency_us = 3\n"),
            "levels[0]: unknown field(s) ['latency_us']",
        ),
        # unknown top-level field
        (TWO_BY_TWO + "\nworld = 4\n", "unknown field(s) ['world']"),
        # no levels
        ('name = "x"\n', "missing field 'levels'"),
        # duplicate level names
        (
            TWO_BY_TWO.replace('name = "node"', 'name = "dc"'),
            "levels[1].name ('dc') must be unique",
        ),
        # a string where a number belongs
        (
            TWO_BY_TWO.replace("latency_ms = 5.0", 'latency_ms = "5"'),
            "levels[0].latency_ms must be a number, got str ('5')",
        ),
    ],
)
def test_invalid_descriptions_name_field_and_rule(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ClusterSpec.from_toml(_write(tmp_path, text))
    assert message in str(info.value)


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ClusterSpec.from_toml(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        ClusterSpec.from_toml(_write(tmp_path, "levels = [[[\n"))


def test_rank_arguments_are_checked() -> None:
    spec = _spec(2, 2)
    with pytest.raises(ValueError, match=r"rank_b \(4\) must be a rank in \[0, 4\)"):
        spec.path(0, 4)
    with pytest.raises(ValueError, match="must differ"):
        spec.separating_level(1, 1)


def test_topology_plan() -> None:
    spec = _spec(2, 3)
    topo = build_topology(spec, run_id="abc123")
    assert all(NAMESPACE_RE.match(ns) for ns in topo.namespaces)
    assert topo.fabric_ns == "msc-abc123-fab" and len(topo.rank_ns) == 6
    assert topo.bridges == ("root", "b0x0", "b0x1")
    veths = [link for link in topo.links if link.kind == "veth"]
    taps = [link for link in topo.links if link.kind == "tap"]
    assert [(v.child_bridge, v.parent_bridge) for v in veths] == [
        ("b0x0", "root"),
        ("b0x1", "root"),
    ]
    # rank 4 = datacenter 1, node 1: its port hangs off datacenter 1's bridge
    assert taps[4].parent_bridge == "b0x1" and taps[4].bandwidth_gbps == 1.0
    assert topo.rank_addresses[0] == "198.18.1.0" and rank_address(300) == "198.18.2.44"
    assert all(len(name) <= 15 for link in topo.links for name in (link.child_dev, link.parent_dev))
    assert topo.delays_ms(0) == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="run_id"):
        build_topology(spec, run_id="ABC")
    with pytest.raises(ValueError, match="mtu_bytes"):
        build_topology(spec, run_id="abc123", mtu_bytes=100)


def test_tbf_arguments() -> None:
    args = tbf_args(0.1, 9000)  # 100 Mbit/s: 1 ms is 12500 bytes, above one 9014-byte frame
    assert args[:3] == ["tbf", "rate", "100000000bit"]
    assert int(args[args.index("burst") + 1]) == 12500
    assert int(args[args.index("limit") + 1]) >= 1_250_000  # 100 ms of queue
    # At a low rate the bucket still holds one whole frame, or every frame would be dropped.
    assert int(tbf_args(0.001, 9000)[4]) == 9014
    # The fastest link a spec allows (100 Tbit/s) still gives numbers tc accepts (< 2^31).
    fastest = tbf_args(1e5, 9000)
    assert fastest[2] == "100000000000000bit"
    assert int(fastest[4]) == int(fastest[6]) == 2**31 - 1


def test_measurement_plan() -> None:
    spec = _spec(2, 2, bw=[0.1, 0.4], lat=[10.0, 2.0])
    plan = measurement_plan(spec, duration_s=0.2)
    assert [p["ranks"] for p in plan["pairs"]] == [(0, 2), (0, 1)]
    assert plan["pairs"][0]["bytes"][1] == int(0.1e9 / 8 * 0.2)
    assert plan["collective_bytes"] % (4 * 4) == 0


def test_cli_show_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from moesaic.cli import main

    assert main(["cluster", "show", "--cluster", str(EXAMPLES / "2dc_2node.toml")]) == 0
    out = capsys.readouterr().out
    assert "2dc_2node: 4 ranks" in out and "ranks 0-2: path 1 Gbit/s, 5 ms one way" in out
    bad = _write(tmp_path, TWO_BY_TWO.replace("world_size = 4", "world_size = 5"))
    assert main(["cluster", "show", "--cluster", str(bad)]) == 2
    assert "world_size (5) must equal" in capsys.readouterr().err
    assert main(["cluster", "down", "--run-id", "xyz"]) == 2
    assert "--run-id ('xyz') must be 6 lowercase hex digits" in capsys.readouterr().err


def test_without_root_or_tools_the_error_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import shutil

    from moesaic.cli import main
    from moesaic.cluster import ClusterError, EmulatedCluster, support_problem

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in support_problem()
    with pytest.raises(ClusterError, match=r"needs root \(CAP_NET_ADMIN\)"):
        EmulatedCluster(_spec(2)).start()
    assert main(["cluster", "down"]) == 2
    assert "needs root" in capsys.readouterr().err
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/x")
    assert "needs 'tc' from iproute2" in support_problem()


def test_emulated_cluster_arguments_are_checked() -> None:
    from moesaic.cluster import EmulatedCluster

    with pytest.raises(ValueError, match=r"world_size \(64\) must be at most max_world_size"):
        EmulatedCluster(_spec(8, 8))
    with pytest.raises(ValueError, match="spec must be a ClusterSpec"):
        EmulatedCluster({"levels": []})


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # issue 9: a latency of 10^12 ms was accepted (and crashed later)
        (
            "latency_ms",
            1e12,
            "levels[0].latency_ms (1000000000000.0) must be a finite number in [0, 10000]",
        ),
        # issue 9: a bandwidth of 1e300 Gbit/s was accepted (and crashed later)
        (
            "bandwidth_gbps",
            1e300,
            "levels[0].bandwidth_gbps (1e+300) must be a finite number in [1e-06, 100000]",
        ),
        # below 1 kbit/s nothing useful crosses a link
        ("bandwidth_gbps", 1e-9, "levels[0].bandwidth_gbps (1e-09) must be a finite number in"),
        # a level as big as a planet's worth of ranks
        ("size", 10**9, "levels[0].size (1000000000) must be <= 1048576"),
    ],
)
def test_absurd_values_are_refused_with_the_allowed_range(
    tmp_path: Path, field: str, value: float, message: str
) -> None:
    text = TWO_BY_TWO.replace("world_size = 4\n", "")
    old = {"latency_ms": "latency_ms = 5.0", "bandwidth_gbps": "bandwidth_gbps = 1\n"}
    old["size"] = "size = 2\nbandwidth_gbps = 1\n"
    new = {
        "latency_ms": f"latency_ms = {value!r}",
        "bandwidth_gbps": f"bandwidth_gbps = {value!r}\n",
    }
    new["size"] = f"size = {value}\nbandwidth_gbps = 1\n"
    with pytest.raises(ValueError) as info:
        ClusterSpec.from_toml(_write(tmp_path, text.replace(old[field], new[field], 1)))
    assert message in str(info.value)
    with pytest.raises(ValueError, match=rf"level\.{field} \("):  # Level(...) checks it too
        ClusterSpec(
            levels=(
                Level(
                    **{
                        "name": "x",
                        "size": 2,
                        "bandwidth_gbps": 1.0,
                        "latency_ms": 1.0,
                        field: value,
                    }
                ),
            )
        )


def test_world_size_is_bounded() -> None:
    # each level is allowed, their product is not: one level's message would not say why
    with pytest.raises(ValueError, match=r"world_size \(1099511627776\) must be <= 1048576"):
        _spec(2**20, 2**20)


def test_both_world_launchers_have_one_signature() -> None:
    import inspect

    from moesaic.cluster import EmulatedCluster
    from moesaic.comm.world import Launcher, LocalLauncher

    local, emulated = LocalLauncher(), EmulatedCluster(_spec(2))  # not started: no root needed
    assert isinstance(local, Launcher) and isinstance(emulated, Launcher)
    for launcher in (local, emulated):
        params = list(inspect.signature(launcher.run).parameters.values())
        assert [p.name for p in params[:4]] == ["fn", "world_size", "args", "timeout_s"]
        assert params[2].kind is inspect.Parameter.VAR_POSITIONAL
        assert params[3].kind is inspect.Parameter.KEYWORD_ONLY
