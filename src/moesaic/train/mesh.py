"""The training mesh's degrees and what may run sharded (torch-free: ``TrainConfig`` checks
them before any worker starts; ``train/fsdp.py`` builds the mesh and shards).

``world = dp_replicate x dp_shard x ep``: see ``train/fsdp.py`` for the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from moesaic.checks import check_positive_int
from moesaic.models.config import MoEGPTConfig
from moesaic.schedule_table import schedule_names, schedule_spec
from moesaic.strategies.registry import check_supported

__all__ = [
    "DIMS",
    "MeshShape",
    "ModelElements",
    "StateBytes",
    "check_sharding",
    "model_elements",
    "state_bytes_per_rank",
]

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


def check_sharding(strategy: str, schedule: str) -> None:
    """Refuse a strategy or a schedule that does not run with FSDP2 sharding, through their
    declarations (``Supports.unsharded_why``, ``ScheduleSpec.unsharded_why``), naming why.

    Raises:
        ValueError: one line naming the strategy or schedule, the options and the reason.
    """
    check_supported(strategy, sharded=True)
    why = schedule_spec(schedule).unsharded_why
    if why:
        runs = [n for n in schedule_names() if not schedule_spec(n).unsharded_why]
        raise ValueError(
            f"schedule {schedule!r} does not run with FSDP sharding (--dp-shard, "
            f"--dp-replicate): {why}; choose --schedule {' or '.join(runs)}"
        )


@dataclass(frozen=True, slots=True)
class ModelElements:
    """An MoEGPT's parameters: dense elements, expert elements (all experts) and tensors."""

    dense: int
    expert: int
    tensors: int


def model_elements(cfg: MoEGPTConfig) -> ModelElements:
    """Count an ``MoEGPT``'s parameters from its config, without building it (torch-free):
    the tied byte embedding (and learned positions), every block's two norms, attention (QKV
    and output, no biases), and its router, routed experts (3 matrices for SwiGLU, 2 for GELU)
    and shared experts, or its dense SwiGLU MLP; the final norm (LayerNorm: weight and bias)."""
    D, moe = cfg.d_model, cfg.moe
    norm_tensors = 1 if cfg.norm == "rmsnorm" else 2
    dense, expert = cfg.vocab_size * D + norm_tensors * D, 0
    tensors = 1 + norm_tensors
    if cfg.positions == "learned":
        dense, tensors = dense + cfg.seq_len * D, tensors + 1
    for i in range(cfg.n_layers):
        dense += 2 * norm_tensors * D + 4 * D * D
        tensors += 2 * norm_tensors + 2
        if cfg.is_moe_block(i):
            mats = 3 if moe.activation == "swiglu" else 2
            dense += moe.num_experts * D  # the router
            expert += mats * moe.num_experts * D * moe.ffn_hidden_size
            tensors += 1 + mats
            if moe.num_shared_experts:
                gate = D if moe.shared_expert_gate else 0
                dense += 3 * D * moe.shared_hidden + gate
                tensors += 3 + bool(gate)
        else:
            dense += 3 * D * (cfg.dense_hidden or 4 * D)
            tensors += 3
    return ModelElements(dense=dense, expert=expert, tensors=tensors)


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Predicted bytes one rank holds of fp32 parameters, gradients and AdamW state."""

    params: float
    grads: float
    optimizer: float


def state_bytes_per_rank(cfg: MoEGPTConfig, shape: MeshShape | None, ep: int) -> StateBytes:
    """What ``train/fsdp.memory_bytes`` measures after the first step, predicted: the dense
    part over ``dp_shard x ep`` ranks (all of it unsharded, ``shape`` None), the experts over
    ``ep x dp_shard``; AdamW twice the parameters plus a 4-byte ``step`` per tensor. FSDP2's
    whole-row shards put up to one row more on the first ranks (0.2% in
    ``benchmarks/results/fsdp_memory.json``)."""
    n = model_elements(cfg)
    dense_ranks = 1 if shape is None else shape.dense_shards
    expert_ranks = ep * (1 if shape is None else shape.dp_shard)
    params = 4.0 * (n.dense / dense_ranks + n.expert / expert_ranks)
    return StateBytes(params=params, grads=params, optimizer=2 * params + 4.0 * n.tensors)
