"""An emulated cluster on one machine: a :class:`NetworkFabric` you can launch jobs on.

Usage::

    spec = ClusterSpec.from_toml("examples/clusters/2dc_2node_small.toml")
    with EmulatedCluster(spec) as cluster:
        results = cluster.run(my_module.my_fn, spec.world_size, 1024, timeout_s=60)  # per rank

``my_fn(rank, world_size, 1024)`` runs in one worker process per rank, inside that rank's
namespace, with a gloo process group already initialised over the emulated network; it must be
importable by reference (a module-level function) and its result picklable. ``run`` has the
signature of every moesaic world launcher (:class:`moesaic.comm.world.Launcher`), so a function
written for :func:`moesaic.comm.world.run_world` runs unchanged on an emulated network.

The two halves live apart: :mod:`moesaic.cluster.fabric` builds and tears down the network
(namespaces, links, shaping, delay line), :mod:`moesaic.cluster.launcher` spawns workers in it
and collects their results.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from moesaic.cluster.fabric import NetworkFabric
from moesaic.cluster.launcher import ClusterLauncher
from moesaic.cluster.spec import ClusterSpec

__all__ = ["EmulatedCluster"]


class EmulatedCluster(NetworkFabric):
    """Builds, runs work on, and tears down one emulated cluster.

    Takes the arguments of :class:`~moesaic.cluster.fabric.NetworkFabric`. The workers, like the
    delay line, are tied to the thread that starts them (parent-death signal): start and use a
    cluster from one long-lived thread, normally the main thread.
    """

    def __init__(self, spec: ClusterSpec, **fabric_kwargs: Any) -> None:
        super().__init__(spec, **fabric_kwargs)
        self.launcher = ClusterLauncher(self)

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout_s: float = 120.0,
        threads: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; see :meth:`ClusterLauncher.run`."""
        return self.launcher.run(
            fn, world_size, *args, timeout_s=timeout_s, threads=threads, env=env
        )

    def _before_close(self) -> None:
        self.launcher.kill_workers()
