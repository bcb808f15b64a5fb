"""The network bound of ``bench layer --cluster``, on hand-made traffic (no root needed)."""

from __future__ import annotations

import pytest

from moesaic.bench.layer import _network_bound_ms
from moesaic.cluster.spec import ClusterSpec, Level

SPEC = ClusterSpec(
    levels=(
        Level(name="datacenter", size=2, bandwidth_gbps=0.1, latency_ms=10.0),
        Level(name="node", size=2, bandwidth_gbps=0.4, latency_ms=3.0),
    )
)


def _ranks(peer_bytes):
    return [{"k": {"peer_bytes_P": row, "collectives_per_step": 5}} for row in peer_bytes]


def test_cross_datacenter_traffic_is_bound_by_the_datacenter_uplink():
    # ranks 0 and 2 (different datacenters) exchange 1 MB each way per forward.
    mb = 1_000_000
    per_rank = _ranks([[0, 0, mb, 0], [0] * 4, [mb, 0, 0, 0], [0] * 4])
    # fwd + bwd: 2 MB out of each datacenter over 100 Mbit/s = 160 ms; 5 x 10 ms latency.
    assert _network_bound_ms(per_rank, "k", SPEC) == pytest.approx(160.0 + 50.0)


def test_traffic_inside_a_datacenter_uses_the_node_uplink():
    mb = 1_000_000
    per_rank = _ranks([[0, mb, 0, 0], [mb, 0, 0, 0], [0] * 4, [0] * 4])
    # 2 MB per step out of node 0 over 400 Mbit/s = 40 ms; nothing leaves the datacenter.
    assert _network_bound_ms(per_rank, "k", SPEC) == pytest.approx(40.0 + 50.0)
