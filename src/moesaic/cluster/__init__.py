"""Emulated clusters on one machine: a cluster description and a network-namespace emulator.

* :mod:`moesaic.cluster.spec` — :class:`ClusterSpec` / :class:`Level`, the TOML cluster
  description shared with the cost model and the simulator.
* :mod:`moesaic.cluster.netns` — :class:`EmulatedCluster`, one namespace per rank joined by
  shaped multi-level links, running torch.distributed (gloo) workers.
* :mod:`moesaic.cluster.verify` — measures bandwidth, latency and collectives on it.
"""

from moesaic.cluster.netns import EmulatedCluster
from moesaic.cluster.spec import ClusterSpec, Level, PathInfo
from moesaic.cluster.system import ClusterError, ClusterTimeout, down, support_problem

__all__ = [
    "ClusterError",
    "ClusterSpec",
    "ClusterTimeout",
    "EmulatedCluster",
    "Level",
    "PathInfo",
    "down",
    "support_problem",
]
