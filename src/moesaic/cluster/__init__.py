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

The names below are imported lazily (PEP 562): ``import moesaic.cluster.spec`` (torch-free, what
the cost model and the simulator read) does not start the emulator's modules, and no submodule's
``from moesaic.cluster import ...`` runs into a half-initialised package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ClusterError": "moesaic.cluster.system",
    "ClusterLauncher": "moesaic.cluster.launcher",
    "ClusterSpec": "moesaic.cluster.spec",
    "ClusterTimeout": "moesaic.cluster.system",
    "DownReport": "moesaic.cluster.lifecycle",
    "EmulatedCluster": "moesaic.cluster.netns",
    "Level": "moesaic.cluster.spec",
    "NetworkFabric": "moesaic.cluster.fabric",
    "PathInfo": "moesaic.cluster.spec",
    "down": "moesaic.cluster.lifecycle",
    "network_time": "moesaic.cluster.cost",
    "support_problem": "moesaic.cluster.system",
    "traffic_time_s": "moesaic.cluster.cost",
}

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

if TYPE_CHECKING:
    from moesaic.cluster.cost import network_time, traffic_time_s
    from moesaic.cluster.fabric import NetworkFabric
    from moesaic.cluster.launcher import ClusterLauncher
    from moesaic.cluster.lifecycle import DownReport, down
    from moesaic.cluster.netns import EmulatedCluster
    from moesaic.cluster.spec import ClusterSpec, Level, PathInfo
    from moesaic.cluster.system import ClusterError, ClusterTimeout, support_problem


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moesaic.cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
