"""Measures the links of an emulated cluster into a simulator profile (``calibrate --cluster``).

Two emulated clusters are brought up, one after the other, in network namespaces
(:class:`moesaic.cluster.netns.EmulatedCluster`, needs root, ``ip`` and ``tc``):

1. the cluster of the TOML file: :func:`moesaic.cluster.verify.check` measures, per level that
   separates some ranks, one rank pair's point-to-point bandwidth (two transfer sizes
   differenced) and one-way latency (fastest ping-pong halved). Each becomes a
   :class:`~moesaic.sim.profile.LinkLevel`; ``bandwidth_scale`` is the median over the levels of
   measured / configured bandwidth;
2. an unshaped pair (100 Gbit/s, 0 ms: far above what tbf, the delay line and gloo sustain):
   its measured one-way latency is ``floor_s``, the least a message costs on this machine, as
   ``benchmarks/cluster_check.py``'s ``unshaped`` entry.

Everything else about the links (sizes, the configured rates the scale multiplies, latencies
above the floor) is the cluster file's. Torch is used by the workers only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from moesaic.checks import check_positive
from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.sim.profile import LinkLevel

__all__ = ["UNSHAPED", "LinkCalibration", "measure_links"]

# The emulator's floor: a link shaped far above what this machine moves (cluster_check.py's).
UNSHAPED = ClusterSpec(
    levels=(Level(name="link", size=2, bandwidth_gbps=100.0, latency_ms=0.0),), name="unshaped"
)


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkCalibration:
    """What :func:`measure_links` measured.

    Attributes:
        links: One entry per separating level of the cluster.
        bandwidth_scale: Median measured / configured bandwidth over ``links``.
        floor_s: One-way latency of the unshaped pair, seconds (0 when not measured).
        collectives: The check's all-to-all and all-reduce medians and bounds (for the record).
    """

    links: tuple[LinkLevel, ...]
    bandwidth_scale: float
    floor_s: float
    collectives: dict[str, Any]


def links_from_report(report: Any) -> tuple[LinkLevel, ...]:
    """:class:`LinkLevel` entries from a :class:`moesaic.cluster.verify.CheckReport`."""
    return tuple(
        LinkLevel(
            level_name=m.level_name,
            configured_bandwidth_gbps=m.configured_bandwidth_gbps,
            measured_bandwidth_gbps=m.measured_bandwidth_gbps,
            configured_latency_ms=m.configured_latency_ms,
            measured_latency_ms=m.measured_latency_ms,
        )
        for m in report.levels
    )


def measure_links(
    spec: ClusterSpec,
    *,
    duration_s: float = 0.3,
    floor: bool = True,
    timeout_s: float = 300.0,
) -> LinkCalibration:
    """Brings up ``spec`` (and the unshaped pair when ``floor``) and measures their links.

    Args:
        spec: The cluster to emulate; at least two ranks.
        duration_s: Target time of each bandwidth transfer at the configured rate.
        floor: Also measure the unshaped pair for ``floor_s`` (one more cluster, a few seconds).
        timeout_s: Bound on each cluster's measurement.

    Raises:
        ValueError: a one-rank cluster (no link to measure).
        moesaic.cluster.ClusterError: the emulated cluster cannot be built (not root, no tc...).
    """
    from moesaic.cluster.netns import EmulatedCluster
    from moesaic.cluster.verify import check

    if not isinstance(spec, ClusterSpec):
        raise ValueError(f"spec must be a ClusterSpec, got {type(spec).__name__}")
    if spec.world_size < 2:
        raise ValueError(f"cluster world_size ({spec.world_size}) must be >= 2 to measure links")
    check_positive("duration_s", duration_s)
    with EmulatedCluster(spec) as cluster:
        report = check(cluster, duration_s=duration_s, timeout_s=timeout_s)
    links = links_from_report(report)
    scale = statistics.median(x.bandwidth_share for x in links)
    floor_s = 0.0
    if floor:
        with EmulatedCluster(UNSHAPED) as cluster:
            unshaped = check(cluster, duration_s=duration_s, timeout_s=timeout_s)
        floor_s = unshaped.levels[0].measured_latency_ms * 1e-3
    collectives = {
        name: {k: c[k] for k in ("bytes_per_rank", "median_s", "bound_s")}
        for name, c in report.collectives.items()
    }
    return LinkCalibration(
        links=links, bandwidth_scale=scale, floor_s=floor_s, collectives=collectives
    )
