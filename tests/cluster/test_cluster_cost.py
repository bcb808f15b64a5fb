"""moesaic.cluster.cost: one network-time model, checked against hand-computed cases (no root)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moesaic.cluster.cost import (
    all_to_all_time_s,
    collective_latency_s,
    network_time,
    ring_all_reduce_time_s,
    traffic_time_s,
    uplink_bytes,
)
from moesaic.cluster.spec import ClusterSpec, Level

MB = 1_000_000


def _spec(*sizes: int, bw: list[float], lat: list[float]) -> ClusterSpec:
    return ClusterSpec(
        levels=tuple(
            Level(name=f"l{i}", size=s, bandwidth_gbps=b, latency_ms=t)
            for i, (s, b, t) in enumerate(zip(sizes, bw, lat))
        )
    )


# 2 datacenters x 2 nodes: 100 Mbit/s between datacenters (10 ms), 400 Mbit/s per node (2 ms)
DC = _spec(2, 2, bw=[0.1, 0.4], lat=[10.0, 2.0])


def _matrix(P: int, entries: dict[tuple[int, int], float]) -> list[list[float]]:
    out = [[0.0] * P for _ in range(P)]
    for (a, b), v in entries.items():
        out[a][b] = v
    return out


def test_one_message_across_datacenters() -> None:
    # 1 MB from rank 0 (dc 0) to rank 2 (dc 1): the dc uplink (100 Mbit/s) takes 8e6 / 1e8 s;
    # rank 0's own uplink (400 Mbit/s) only 8e6 / 4e8 s.
    bytes_PP = _matrix(4, {(0, 2): MB})
    t = network_time(DC, bytes_PP, collectives=3)
    assert t.bandwidth_s == pytest.approx(0.08)
    assert t.busiest_level == 0 and t.busiest_bytes == MB
    assert t.latency_s == pytest.approx(3 * 0.010)  # 3 collectives x the 10 ms outermost path
    assert traffic_time_s(DC, bytes_PP, collectives=3) == pytest.approx(0.11)
    assert uplink_bytes(DC, bytes_PP) == [
        [(MB, 0.0), (0.0, MB)],  # dc 0 sends it up, dc 1 receives it
        [(MB, 0.0), (0.0, 0.0), (0.0, MB), (0.0, 0.0)],
    ]


def test_traffic_inside_a_datacenter_never_touches_its_uplink() -> None:
    t = network_time(DC, _matrix(4, {(0, 1): MB, (3, 2): MB}))
    assert t.busiest_level == 1 and t.bandwidth_s == pytest.approx(8e6 / 4e8)


def test_the_receiving_direction_can_be_the_bottleneck() -> None:
    # Ranks 1, 2, 3 each send 1 MB to rank 0 (an incast) over fast datacenter links and thin
    # 100 Mbit/s node links: rank 0's downlink carries 3 MB, every uplink at most 1 MB.
    spec = _spec(2, 2, bw=[1.0, 0.1], lat=[5.0, 1.0])
    t = network_time(spec, _matrix(4, {(1, 0): MB, (2, 0): MB, (3, 0): MB}))
    assert t.busiest_level == 1 and t.busiest_bytes == 3 * MB
    assert t.bandwidth_s == pytest.approx(3 * 8e6 / 1e8)


def test_a_slow_inner_level_of_size_one_is_crossed() -> None:
    # 2 dc x 1 node x 2 gpus; the node's 100 Mbit/s NIC is slower than the WAN (1 Gbit/s)
    spec = _spec(2, 1, 2, bw=[1.0, 0.1, 10.0], lat=[5.0, 1.0, 0.5])
    t = network_time(spec, _matrix(4, {(0, 2): MB}), collectives=1)
    assert t.busiest_level == 1 and t.bandwidth_s == pytest.approx(0.08)
    assert t.latency_s == pytest.approx(0.005)


def test_self_traffic_and_single_rank_worlds_cost_nothing() -> None:
    assert traffic_time_s(DC, _matrix(4, {(1, 1): 1e12})) == 0.0
    assert network_time(DC, _matrix(4, {})).busiest_level is None
    one = _spec(1, bw=[1.0], lat=[5.0])
    assert collective_latency_s(one) == 0.0
    assert traffic_time_s(one, [[7.0]], collectives=4) == 0.0
    assert all_to_all_time_s(one, MB) == 0.0 and ring_all_reduce_time_s(one, MB) == 0.0


def test_collectives_through_the_same_function() -> None:
    # all-to-all: each dc uplink carries 2 ranks x 2 ranks x 1 MB per direction at 100 Mbit/s,
    # plus one 10 ms latency
    assert all_to_all_time_s(DC, MB) == pytest.approx(4e6 * 8 / 1e8 + 0.010)
    # ring 0->1->2->3->0: each dc uplink carries one edge per direction; 6 steps of a quarter
    chunk_s = MB / 4 * 8 / 1e8
    assert ring_all_reduce_time_s(DC, MB) == pytest.approx(6 * (chunk_s + 0.010))


def test_tuples_and_tolist_rows_are_accepted() -> None:
    class Row:  # a tensor-like row (torch.Tensor and numpy arrays have tolist())
        def __init__(self, values: list[float]) -> None:
            self.values = values

        def tolist(self) -> list[float]:
            return self.values

    rows = [tuple(r) for r in _matrix(4, {(0, 2): MB})]
    assert traffic_time_s(DC, rows) == traffic_time_s(DC, [Row(list(r)) for r in rows])


@pytest.mark.parametrize(
    ("bytes_PP", "collectives", "message"),
    [
        ([[0.0] * 4] * 3, 0, r"bytes_PP must have world_size \(4\) rows, got 3"),
        ([[0.0] * 4] * 3 + [[0.0] * 5], 0, r"bytes_PP\[3\] must have world_size \(4\) entries"),
        (_matrix(4, {(1, 2): -1.0}), 0, r"bytes_PP\[1\]\[2\] \(-1.0\) must be a finite number"),
        (_matrix(4, {(2, 3): float("nan")}), 0, r"bytes_PP\[2\]\[3\] \(nan\)"),
        (_matrix(4, {(0, 1): True}), 0, r"bytes_PP\[0\]\[1\] \(True\)"),
        (_matrix(4, {}), -1, r"collectives \(-1\) must be >= 0"),
    ],
)
def test_bad_input_names_the_entry(bytes_PP: list, collectives: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        traffic_time_s(DC, bytes_PP, collectives=collectives)


def test_cost_model_is_torch_free() -> None:
    code = "import sys, moesaic.cluster.cost; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_bench_network_bound_uses_the_cost_model() -> None:
    from moesaic.bench.layer import _network_bound_ms

    # Every rank sends 1 MB to every other rank in the forward, so 2 MB per pair per step: a
    # datacenter uplink carries 2 x 2 ranks x 2 MB = 8 MB at 100 Mbit/s (0.64 s), a node uplink
    # 3 x 2 MB at 400 Mbit/s (0.12 s); 5 collectives x 10 ms.
    per_rank = [
        {"k": {"peer_bytes_P": [0 if a == b else MB for b in range(4)], "collectives_per_step": 5}}
        for a in range(4)
    ]
    assert _network_bound_ms(per_rank, "k", DC) == pytest.approx(640.0 + 50.0)
