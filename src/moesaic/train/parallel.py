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

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moesaic.comm.collectives import EPGroup
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
    timeout = datetime.timedelta(seconds=timeout_s)
    dp_size = W // ep_size
    ep_group = dp_group = None
    for d in range(dp_size):
        g = dist.new_group(list(range(d * ep_size, (d + 1) * ep_size)), timeout=timeout)
        if r // ep_size == d:
            ep_group = g
    for j in range(ep_size):
        g = dist.new_group(list(range(j, W, ep_size)), timeout=timeout)
        if r % ep_size == j:
            dp_group = g
    return Layout(
        rank=r,
        world_size=W,
        ep_size=ep_size,
        ep_group=ep_group,
        world=EPGroup(None, timeout_s),
        ep=EPGroup(ep_group, timeout_s),
        dp=EPGroup(dp_group, timeout_s),
    )


def _all_reduce_mean(grads: list[torch.Tensor], group: EPGroup, world_size: int, what: str) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    group.all_reduce(flat, what=what)
    flat.div_(world_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_gradients(model: nn.Module, layout: Layout) -> None:
    """Apply the EP x DP gradient rules (see the module docstring) to ``model``'s ``.grad``."""
    replicated, expert = [], []
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # keep every rank's flat buffer the same layout
        (expert if is_expert_param(p) else replicated).append(p.grad)
    W = layout.world_size
    _all_reduce_mean(replicated, layout.world, W, "all_reduce of replicated gradients")
    _all_reduce_mean(expert, layout.dp, W, "all_reduce of expert gradients over the DP group")


def clip_grad_norm(model: nn.Module, layout: Layout, max_norm: float) -> float:
    """Clip the global gradient norm (after ``sync_gradients``); returns the norm before clipping.

    Replicated gradients are equal on every rank; an expert shard's gradients are equal over its
    DP group, and the EP group holds all shards once: the global squared norm is the replicated
    part plus the EP-group sum of the expert parts.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    device = params[0].grad.device if params else torch.device("cpu")
    rep_sq = torch.zeros((), dtype=torch.float64, device=device)
    exp_sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        sq = p.grad.detach().double().square().sum()
        if is_expert_param(p):
            exp_sq += sq
        else:
            rep_sq += sq
    layout.ep.all_reduce(exp_sq, what="all_reduce of the expert gradient norm")
    norm = math.sqrt(float(rep_sq + exp_sq))
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(scale)
    return norm
