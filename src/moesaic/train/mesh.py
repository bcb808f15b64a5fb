"""The training mesh's degrees and what may run sharded (torch-free: ``TrainConfig`` checks
them before any worker starts; ``train/fsdp.py`` builds the mesh and shards; what a mesh
holds per rank: ``moesaic.sim.memory``).

``world = dp_replicate x dp_shard x ep``: see ``train/fsdp.py`` for the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from moesaic.checks import check_positive_int
from moesaic.planning.sharding import check_sharding

__all__ = ["DIMS", "MeshShape", "check_sharding"]

DIMS = ("dp_replicate", "dp_shard", "ep")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshShape:
    """The degrees of the training mesh.

    Attributes:
        dp_replicate: replicas of the whole sharded model (HSDP); gradients are all-reduced
            across them after the reduce-scatter.
        dp_shard: FSDP degree beside EP: the ranks an EP rank's experts are sharded over
            (torchtitan's efsdp); the dense part is sharded over ``dp_shard * ep`` ranks.
        ep: expert parallelism (consecutive ranks).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            check_positive_int(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def dense_shards(self) -> int:
        """How many ranks the dense parameters are sharded over (``dp_shard * ep``)."""
        return self.dp_shard * self.ep

    def check_world(self, world_size: int) -> None:
        """Refuse a world that is not ``dp_replicate x dp_shard x ep`` ranks."""
        if world_size != self.world_size:
            raise ValueError(
                f"the world size ({world_size}) must be dp_replicate ({self.dp_replicate}) x "
                f"dp_shard ({self.dp_shard}) x ep ({self.ep}) = {self.world_size}"
            )
