"""Emulated clusters on one machine: a cluster description, a cost model and an emulator.

* :mod:`moesaic.cluster.spec` — :class:`ClusterSpec` / :class:`Level`, the TOML cluster
  description shared by the emulator, the cost model and the simulator (torch-free).
* :mod:`moesaic.cluster.cost` — :func:`traffic_time_s`, the network time of a P x P traffic
  matrix on a spec (torch-free).
* :mod:`moesaic.cluster.fabric` — :class:`NetworkFabric`, one namespace per rank joined by shaped
  multi-level links; :mod:`moesaic.cluster.launcher` — :class:`ClusterLauncher`, runs
  torch.distributed (gloo) workers on it; :mod:`moesaic.cluster.netns` — :class:`EmulatedCluster`,
  the two together.
* :mod:`moesaic.cluster.lifecycle` — owner records, liveness and :func:`down`.
* :mod:`moesaic.cluster.verify` — measures bandwidth, latency and collectives on it.
"""

from moesaic.cluster.cost import network_time, traffic_time_s
from moesaic.cluster.fabric import NetworkFabric
from moesaic.cluster.launcher import ClusterLauncher
from moesaic.cluster.lifecycle import DownReport, down
from moesaic.cluster.netns import EmulatedCluster
from moesaic.cluster.spec import ClusterSpec, Level, PathInfo
from moesaic.cluster.system import ClusterError, ClusterTimeout, support_problem

__all__ = [
    "ClusterError",
    "ClusterLauncher",
    "ClusterSpec",
    "ClusterTimeout",
    "DownReport",
    "EmulatedCluster",
    "Level",
    "NetworkFabric",
    "PathInfo",
    "down",
    "network_time",
    "support_problem",
    "traffic_time_s",
]
