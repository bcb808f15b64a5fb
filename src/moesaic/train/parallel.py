"""Expert parallelism x data parallelism: process groups and the gradient rules.

With W = DP x EP ranks, rank r sits in EP group ``r // EP`` (ranks ``[d*EP, (d+1)*EP)``: tokens
move only inside it) at EP rank ``r % EP``, and in the DP group of its expert shard (ranks
``{d*EP + r % EP}``: the replicas of the same experts). After a backward of a per-rank mean loss:

* replicated parameters (attention, norms, embeddings, routers) are summed over all W ranks;
* expert parameters already hold the gradients of every token of their EP group (the combine
  all-to-all brought them back), so they are summed over their DP group only;
* both are divided by W: the global loss is the mean of the W per-rank losses.

Every collective goes through ``EPGroup``, which waits with a deadline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moesaic.comm.collectives import EPGroup
from moesaic.comm.groups import registry
from moesaic.gradnorm import square_norm_sum
from moesaic.layer import is_expert_param


@dataclass(kw_only=True, slots=True)
class Layout:
    """This rank's place in the EP x DP grid and its process groups."""

    rank: int
    world_size: int
    ep_size: int
    ep_group: dist.ProcessGroup | None
    world: EPGroup
    ep: EPGroup
    dp: EPGroup

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ep_size


def build_layout(ep_size: int, timeout_s: float) -> Layout:
    """Create the EP and DP groups (every rank creates every group, in the same order)."""
    if not dist.is_initialized():
        world = EPGroup(None, timeout_s)
        return Layout(
            rank=0, world_size=1, ep_size=1, ep_group=None, world=world, ep=world, dp=world
        )
    W, r = dist.get_world_size(), dist.get_rank()
    if W % ep_size:
        raise ValueError(f"ep ({ep_size}) must divide the world size ({W})")
    dp_size = W // ep_size
    ep_sets = [list(range(d * ep_size, (d + 1) * ep_size)) for d in range(dp_size)]
    dp_sets = [list(range(j, W, ep_size)) for j in range(ep_size)]
    # From the world's registry (every rank creates every group, in one order): the same
    # communicators as any layer or schedule that asks for these rank sets later.
    reg = registry()
    # An EP size of 1 still gets a group of its own rank: the model's layers take a process
    # group, and None would mean the whole world.
    reg.create([*ep_sets, *dp_sets], "main", timeout_s, singletons=ep_size == 1)
    ep_ranks, dp_ranks = ep_sets[r // ep_size], dp_sets[r % ep_size]
    ep_group = reg.lookup(ep_ranks)
    world = EPGroup(None, timeout_s)
    return Layout(
        rank=r,
        world_size=W,
        ep_size=ep_size,
        ep_group=ep_group,
        world=world,
        ep=EPGroup(ep_group, timeout_s),
        dp=EPGroup(reg.lookup(dp_ranks), timeout_s) if dp_size > 1 else EPGroup.solo(timeout_s),
    )


def _all_reduce_mean(grads: list[torch.Tensor], group: EPGroup, divisor: int, what: str) -> None:
    if not grads:
        return
    if group.size == 1:
        # nothing to sum (expert shards without replicas): divide in place; flattening into
        # one buffer and copying back cost a vanilla step 348 -> 324 ms (2 ranks, 14 experts
        # of 176 x 572 each; benchmarks/results/vanilla_sync_ab.json). At a world of one
        # nothing at all: dividing by 1 read and wrote every gradient (5 ms of an H200 step
        # with 12 GB of them).
        if divisor != 1:
            torch._foreach_div_(grads, divisor)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.all_reduce(flat, what=what)
    flat.div_(divisor)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class GradientSync:
    """The EP x DP gradient rules of ``layout`` (see the module docstring).

    Implements ``moesaic.schedule.base.GradientSync``: ``sync`` reduces everything after the
    backward in two flat all-reduces; a schedule that reduces while the backward runs uses
    ``group_of`` and ``divisor`` per parameter instead.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    @property
    def divisor(self) -> int:
        return self.layout.world_size

    def group_of(self, param: torch.Tensor) -> EPGroup:
        """Expert shards: their DP group; everything else: all ranks."""
        return self.layout.dp if is_expert_param(param) else self.layout.world

    def sync(self, params: Sequence[torch.Tensor]) -> None:
        """Sum and divide every gradient (a missing one counts as zeros, so that every rank's
        flat buffer has the same layout)."""
        replicated: list[torch.Tensor] = []
        expert: list[torch.Tensor] = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            (expert if is_expert_param(p) else replicated).append(p.grad)
        W = self.divisor
        world, dp = self.layout.world, self.layout.dp
        _all_reduce_mean(replicated, world, W, "all_reduce of replicated gradients")
        _all_reduce_mean(expert, dp, W, "all_reduce of expert gradients over the DP group")

    def global_norm(self, params: Sequence[torch.Tensor]) -> float:
        """The global gradient norm after ``sync`` (the same float on every rank).

        Replicated gradients are equal on every rank; an expert shard's gradients are equal over
        its DP group, and the EP group holds all shards once: the global squared norm is the
        replicated part plus the EP-group sum of the expert parts.
        """
        # the parameters' device, not the gradients': a rank without gradients must still
        # all-reduce a tensor of the same backend as its peers (CPU -> gloo, CUDA -> NCCL)
        device = params[0].device if params else torch.device("cpu")
        replicated: list[torch.Tensor] = []
        expert: list[torch.Tensor] = []
        for p in params:
            if p.grad is not None:
                (expert if is_expert_param(p) else replicated).append(p.grad)
        rep_sq = square_norm_sum(replicated, device)
        exp_sq = square_norm_sum(expert, device)
        self.layout.ep.all_reduce(exp_sq, what="all_reduce of the expert gradient norm")
        return math.sqrt(float(rep_sq + exp_sq))

    def all_ranks(self, flags_F: torch.Tensor) -> torch.Tensor:
        """Every rank's ``flags_F`` ([1, F]) stacked in rank order, ``[P, F]``."""
        world = self.layout.world
        return world.all_gather_dim0(
            flags_F.to(world.control_device), "all_gather of step health flags"
        )

    def sum_ranks(self, values_N: torch.Tensor) -> torch.Tensor:
        """``values_N`` summed over every rank (one all-reduce on the control plane)."""
        world = self.layout.world
        out = values_N.to(world.control_device, copy=True)
        world.all_reduce(out, what="all_reduce of step health flags and statistics")
        return out
