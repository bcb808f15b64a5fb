"""FSDP2 sharding composed with expert parallelism, on one ``DeviceMesh`` (issue 50).

Shape legend: e local experts of an EP rank, H hidden, F expert hidden, W ranks.

The world is laid out as torchtitan lays out FSDP + EP, with EP borrowing ranks from the
data-parallel shard dimension (``torchtitan/distributed/parallel_dims.py``):

```
world = dp_replicate x dp_shard x ep        init_device_mesh(("world",)), unflattened twice

dense parameters   [dp_replicate, dp_shard_ep]   sharded over dp_shard x ep ranks (every rank of
                                                 a replica: EP's ranks shard the dense part too)
expert parameters  [dp_replicate, dp_shard]      an EP rank's e experts sharded over the dp_shard
                                                 ranks beside it (torchtitan's "efsdp"); EP splits
                                                 the experts themselves
```

``ep`` is innermost, so EP groups are consecutive ranks, as in ``train.parallel.build_layout``:
the model's all-to-alls run on the same rank sets with and without sharding. Both parts are
wrapped with ``torch.distributed.fsdp.fully_shard`` (FSDP2): each block's experts on the
expert mesh, each block on the dense mesh, then the root (embedding, final norm, tied head). No
sharding is written by hand here: FSDP2 all-gathers a unit's parameters in its forward and
reduce-scatters its gradients in the backward.

One gradient rule for both parts, the unsharded run's (``train.parallel``): the sum over the
ranks that hold copies of the gradient, divided by W (the loss is the mean of the W per-rank
losses). FSDP2 divides by the size of its mesh by default; the experts' mesh has W / ep ranks,
so both parts get ``set_gradient_divide_factor(W)``. That factor is not the mesh size, which
FSDP2 would reduce with ``ReduceOp.PREMUL_SUM`` (NCCL only; gloo has none), so both also get
``set_force_sum_reduction_for_comms(True)``: a SUM reduce-scatter (and a SUM all-reduce over
``dp_replicate`` for HSDP), then a division by W: the path that runs on gloo and NCCL alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

from moesaic.comm.collectives import EPGroup
from moesaic.experts import GroupedExperts
from moesaic.gradnorm import square_norm
from moesaic.layer import is_expert_param
from moesaic.routing import Router
from moesaic.train.mesh import DIMS, MeshShape, check_sharding

__all__ = [
    "MeshShape",
    "ShardedGradientSync",
    "TrainingMesh",
    "build_mesh",
    "check_sharding",
    "reshard",
    "shard_model",
]

DENSE_SHARD = "dp_shard_ep"  # the flattened dp_shard x ep dimension the dense part shards over


@dataclass(slots=True)
class TrainingMesh:
    """The device mesh of a sharded run and the sub-meshes FSDP2 shards over.

    Attributes:
        shape: the degrees.
        mesh: the world mesh ``[dp_replicate, dp_shard, ep]``.
        dense: the dense parameters' mesh: ``[dp_replicate, dp_shard_ep]`` (HSDP) or
            ``[dp_shard_ep]``.
        experts: the experts' mesh: ``[dp_replicate, dp_shard]`` or ``[dp_shard]``.
        norm_group: the ranks of one replica (``dp_shard_ep``): every dense and every expert
            shard once, so one all-reduce over it gives the global gradient norm.
    """

    shape: MeshShape
    mesh: DeviceMesh
    dense: DeviceMesh
    experts: DeviceMesh
    norm_group: EPGroup


def build_mesh(shape: MeshShape, device_type: str, timeout_s: float) -> TrainingMesh:
    """The training mesh on the initialised world (a collective: every rank, same order).

    Raises:
        ValueError: the world is not ``shape.world_size`` ranks.
    """
    shape.check_world(dist.get_world_size())
    # One world mesh unflattened twice (as torchtitan does): the [dp_replicate, dp_shard, ep]
    # layout and the dense parts' [dp_replicate, dp_shard_ep], the same ranks in the same order
    world = init_device_mesh(device_type, (shape.world_size,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (shape.dp_replicate, shape.dp_shard, shape.ep), DIMS)
    dense_2d = world._unflatten(
        0, (shape.dp_replicate, shape.dense_shards), ("dp_replicate", DENSE_SHARD)
    )
    replicated = shape.dp_replicate > 1
    dense = dense_2d if replicated else dense_2d[DENSE_SHARD]
    experts = mesh["dp_replicate", "dp_shard"] if replicated else mesh["dp_shard"]
    norm_group = EPGroup(dense_2d.get_group(DENSE_SHARD), timeout_s)
    return TrainingMesh(shape=shape, mesh=mesh, dense=dense, experts=experts, norm_group=norm_group)


def _expert_shard(param: nn.Parameter) -> Shard:
    """Experts' ``[e, H, F]`` weights are sharded along H, not along the experts (torchtitan
    shards dim 0 when the experts divide evenly): every local expert's ``[H, F]`` slice is then
    itself sharded over ``dp_shard``, so the checkpoint keeps one key per global expert
    (``train/checkpoint.py``: ``model.<layer>.experts.<w>.<g>``, here a DTensor), which DCP
    reshards to another ``dp_shard`` and another EP, and checkpoints written before sharding
    load unchanged. The bytes per rank are the same either way (1 / dp_shard of the experts)."""
    return Shard(1)


def _one_rule(module: FSDPModule, world_size: int, mesh: DeviceMesh) -> None:
    """Sum, then divide by W (module docstring): the unsharded run's rule, on gloo too.

    Sums are forced only where the unit's shard dimension has more than one rank: with one,
    FSDP2 (torch 2.13, ``foreach_reduce``) issues no reduce-scatter, divides the gradient by
    the factor while copying it, and with sums forced divides it by the factor a second time
    after the (HSDP) all-reduce: the experts' gradients came out W times too small in the
    HSDP parity test. Unforced, that path divides once and all-reduces with SUM (the
    ``PREMUL_SUM`` gloo lacks belongs to the reduce-scatter that is not issued).
    """
    module.set_gradient_divide_factor(float(world_size))
    module.set_force_sum_reduction_for_comms(mesh.size(mesh.ndim - 1) > 1)


def shard_model(
    model: nn.Module,
    mesh: TrainingMesh,
    compute_dtype: torch.dtype | None = None,
    *,
    prefetch: bool = True,
) -> nn.Module:
    """Wrap ``model`` (an ``MoEGPT``: ``blocks`` an ``nn.ModuleList``) with FSDP2 in place.

    Units: each block's ``GroupedExperts`` on the expert mesh; each MoE layer's router and each
    block on the dense mesh; then the root (embedding, final norm, tied head). The expert
    marks (``layer.is_expert_param``) move to the sharded parameters that replace the
    originals. Build the optimizer after this call.

    The pipelined schedules call a block's stages and the root's ``embed``/``head``, not their
    ``forward``: those are registered as FSDP forward methods (all-gather before, reshard and
    the backward hooks after), and the router is a unit of its own because they call the gate
    (``MoELayer.route``) between two stages, when the block's parameters are sharded again.
    ``forward`` runs the same bodies without the registered methods (``models/gpt.py``), so
    a whole-model call gathers each unit once a pass: on the tests' 2-block model, vanilla
    gathers 13 times a step (7 units forward, the 6 block units again backward; the root stays
    gathered), against 23 when ``forward`` went through the registered stages
    (``tests/train/test_fsdp.py`` counts them per unit).

    ``compute_dtype`` (bf16): mixed precision through FSDP2's ``MixedPrecisionPolicy`` instead
    of autocast: the blocks and experts are all-gathered in it and compute in it, their
    gradients reduced in fp32 into fp32 master shards; the routers and the root (embedding,
    final norm, tied head) keep fp32 parameters and take their inputs in fp32, as the
    autocast path keeps them.

    ``prefetch``: explicit forward/backward prefetch (``_prefetch``); off for a schedule that
    runs the stages chunk by chunk (``ScheduleSpec.pipelined``), where a prefetched unit is
    resharded after the current chunk's stage and gathered again: measured on the tests' 2-block
    model, a moe-only step at R = 2 issued 31 FSDP2 all-gathers with it, 25 without (R per
    block unit and pass, the root once).
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):  # e.g. --hf-config's stage views
        raise ValueError(
            f"shard_model needs a model whose blocks are an nn.ModuleList (MoEGPT): each block "
            f"is an FSDP2 unit and its experts one on the expert mesh; got "
            f"{type(model).__name__}"
        )
    W = mesh.shape.world_size
    low = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    fp32 = MixedPrecisionPolicy()
    if compute_dtype is not None:  # inputs of the fp32 units cast back to fp32
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    units: list[list[FSDPModule]] = []  # per block: the block, then its router and experts
    for block in blocks:
        inner: list[FSDPModule] = []
        for module in block.modules():
            if isinstance(module, GroupedExperts):
                unit = fully_shard(
                    module, mesh=mesh.experts, shard_placement_fn=_expert_shard, mp_policy=low
                )
                _one_rule(unit, W, mesh.experts)
                inner.append(unit)
                for p in module.parameters():
                    p._moesaic_expert = True  # type: ignore[attr-defined]
            elif isinstance(module, Router):
                inner.append(fully_shard(module, mesh=mesh.dense, mp_policy=fp32))
                _one_rule(inner[-1], W, mesh.dense)
        units.append([fully_shard(block, mesh=mesh.dense, mp_policy=low), *inner])
        _one_rule(units[-1][0], W, mesh.dense)
        for stage in ("attention_stage", "expert_stage"):
            if callable(getattr(type(block), stage, None)):
                register_fsdp_forward_method(block, stage)
    _one_rule(fully_shard(model, mesh=mesh.dense, mp_policy=fp32), W, mesh.dense)
    for method in ("embed", "head"):
        if callable(getattr(type(model), method, None)):
            register_fsdp_forward_method(model, method)
    if prefetch:
        _prefetch(units)
    return model


def reshard(model: nn.Module) -> None:
    """Every FSDP2 unit of ``model`` back to its shards. FSDP2 keeps the root gathered after
    its forward (the backward would gather it again at once), and the backward reshards it;
    a forward that no backward follows (validation) leaves it gathered, which neither the
    next step's hooks nor a checkpoint's state dict expect (a save read freed storage:
    SIGSEGV). A model not sharded is left as it is."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _prefetch(units: list[list[FSDPModule]]) -> None:
    """Explicit prefetch, as torchtitan sets it for MoE: entering block i's forward starts the
    all-gathers of block i + 1, its router and its experts; entering its backward those of
    block i - 1. FSDP2's implicit prefetch follows the order of the previous forward, but an
    MoE layer's host sync (the dispatch's split sizes read on the host) stalls the issuing
    thread before the next unit's all-gather is issued; explicitly, it is already in flight."""
    for i, block in enumerate(units):
        if i + 1 < len(units):
            block[0].set_modules_to_forward_prefetch(units[i + 1])
        if i > 0:
            block[0].set_modules_to_backward_prefetch(units[i - 1])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedGradientSync:
    """The gradient rules of a sharded run (``moesaic.schedule.base.GradientSync``).

    FSDP2 reduce-scatters every gradient in the backward with the unsharded run's rule (sum,
    divide by W; module docstring), so ``sync`` only gives a parameter without a gradient a
    zero one, as ``train.parallel.GradientSync.sync`` does (AdamW then moves every parameter
    alike in both runs). The global norm sums the squares of this rank's dense and expert
    shards and all-reduces them once over the ranks of one replica, which hold every shard of
    both parts exactly once (expert and dense norms combined in one collective).

    Args:
        mesh: the training mesh.
        world: the whole world (health flags).
    """

    def __init__(self, mesh: TrainingMesh, world: EPGroup) -> None:
        self.mesh = mesh
        self.world = world

    @property
    def divisor(self) -> int:
        return self.mesh.shape.world_size

    def group_of(self, param: torch.Tensor) -> EPGroup:
        """Not used: FSDP2 reduces in the backward, and the pipelined schedules that would ask
        are refused with sharding (``check_sharding``)."""
        raise NotImplementedError("sharded gradients are reduced by FSDP2, not per parameter")

    def sync(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def global_norm(self, params: Sequence[torch.Tensor]) -> float:
        device = _local(params[0]).device if params else torch.device("cpu")
        sq = torch.zeros(2, dtype=torch.float64, device=device)  # [dense, experts]
        for p in params:
            if p.grad is not None:
                sq[int(is_expert_param(p))] += square_norm(_local(p.grad))
        self.mesh.norm_group.all_reduce(sq, what="all_reduce of the sharded gradient norms")
        return math.sqrt(float(sq.sum()))

    def all_ranks(self, flags_F: torch.Tensor) -> torch.Tensor:
        return self.world.all_gather_dim0(
            flags_F.to(self.world.control_device), "all_gather of step health flags"
        )

    def sum_ranks(self, values_N: torch.Tensor) -> torch.Tensor:
        out = values_N.to(self.world.control_device, copy=True)
        self.world.all_reduce(out, what="all_reduce of step health flags and statistics")
        return out
