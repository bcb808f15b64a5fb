"""MoELayer: router -> dispatcher -> grouped experts -> dispatcher, the public nn.Module.

Shape legend: T tokens on this rank, H hidden, F expert hidden, E experts, e = E / P local
experts, P ranks in the expert-parallel group, M rows received for the local experts.

Expert parallelism with data parallelism: the layer only moves tokens inside its expert-parallel
group. Parameters marked ``_moesaic_expert`` (w1, w2, w3) are sharded over that group and their
gradients already hold the contributions of every rank's tokens (the combine all-to-all carries
them back), so they must be all-reduced only across replicas of the same shard (the DP
dimension), never across the EP group. The router (and everything else) is replicated: its
gradient must be all-reduced across all ranks. See docs/architecture.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moesaic.comm.collectives import EPGroup
from moesaic.comm.dispatchers import CommStats, make_dispatcher
from moesaic.config import MoEConfig
from moesaic.experts import GroupedExperts
from moesaic.routing import Router

EXPERT_PARAMS = ("w1", "w3", "w2")


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer with expert parallelism.

    Args:
        config: layer shape and behaviour.
        group: the expert-parallel process group; None = the default world when
            torch.distributed is initialised, else a single process holding all experts.

    After ``forward``, ``aux_loss`` holds that forward's weighted load-balancing + z-loss (a
    scalar in the graph), ``last_counts_E`` the kept assignments per expert on this rank and
    ``comm_stats`` the bytes the dispatcher sent.
    """

    def __init__(self, config: MoEConfig, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.ep = EPGroup(group, config.collective_timeout_s)
        config.check_ep_size(self.ep.size)
        self.num_local_experts = config.num_experts // self.ep.size
        self.router = Router(config)
        self.experts = GroupedExperts(
            config, self.num_local_experts, self.ep.rank * self.num_local_experts
        )
        self.dispatcher = make_dispatcher(config.dispatcher, self.ep, config.num_experts)
        self.aux_loss: torch.Tensor | None = None
        self.last_counts_E: torch.Tensor | None = None
        self.reset_parameters()

    @property
    def ep_size(self) -> int:
        return self.ep.size

    @property
    def comm_stats(self) -> CommStats:
        return self.dispatcher.stats

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Init from the default RNG, consuming the same draws whatever the EP size.

        The router draws its [E, H] normal weight; then one 62-bit base seed is drawn, and each
        expert's weights come from a generator seeded by (base seed, global expert id). Rank r
        at EP size k therefore holds exactly experts ``[r*e, (r+1)*e)`` of the EP = 1 layer.
        Ranks must be seeded alike (as with any replicated model).
        """
        std = self.config.init_std if self.config.init_std is not None else 0.02
        self.router.weight.normal_(0.0, std)
        base_seed = int(torch.randint(0, 2**62, (1,)).item())
        self.experts.reset_parameters(base_seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MoE FFN to ``x`` [..., H]; returns the same shape and dtype."""
        H = self.config.hidden_size
        if not torch.is_floating_point(x):
            raise ValueError(f"input must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != H:
            raise ValueError(
                f"input's last dimension ({x.shape[-1] if x.dim() else 'scalar'}) must equal "
                f"hidden_size ({H})"
            )
        x_TH = x.reshape(-1, H)
        plan, aux = self.router(x_TH, self.ep.size)
        self.aux_loss = aux
        self.last_counts_E = plan.counts_E.detach()
        x_MH, handle = self.dispatcher.dispatch(x_TH, plan)
        y_MH = self.experts(x_MH, handle.counts_e)
        y_TH = self.dispatcher.combine(y_MH, handle)
        return y_TH.to(x.dtype).view(x.shape)

    # ---- EP-size-independent state ---------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole layer's state (all E experts), gathered over the EP group; same on all ranks.

        Keys: ``router.weight`` [E, H], ``experts.w1`` / ``experts.w3`` [E, H, F],
        ``experts.w2`` [E, F, H]. A collective: every rank of the group must call it.
        """
        sd = {"router.weight": self.router.weight.detach().clone()}
        for name in EXPERT_PARAMS:
            w = getattr(self.experts, name)
            if w is not None:
                sd[f"experts.{name}"] = self.ep.all_gather_dim0(
                    w.detach(), f"full_state_dict gather of experts.{name}"
                )
        return sd

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a full (EP-size-independent) state, keeping this rank's expert shard."""
        expected = set(self.full_state_keys())
        if set(sd) != expected:
            missing, extra = expected - set(sd), set(sd) - expected
            raise ValueError(
                f"state dict keys must be {sorted(expected)}; missing {sorted(missing)}, "
                f"unexpected {sorted(extra)}"
            )
        self._copy_checked("router.weight", self.router.weight, sd["router.weight"])
        lo = self.ep.rank * self.num_local_experts
        hi = lo + self.num_local_experts
        for name in EXPERT_PARAMS:
            w = getattr(self.experts, name)
            if w is None:
                continue
            full = sd[f"experts.{name}"]
            want = (self.config.num_experts, *w.shape[1:])
            if tuple(full.shape) != want:
                raise ValueError(
                    f"experts.{name} has shape {tuple(full.shape)}, must be {want} "
                    "(all experts, as full_state_dict() returns)"
                )
            w.copy_(full[lo:hi])

    def full_state_keys(self) -> list[str]:
        keys = ["router.weight"]
        keys += [f"experts.{n}" for n in EXPERT_PARAMS if getattr(self.experts, n) is not None]
        return keys

    @staticmethod
    def _copy_checked(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{name} has shape {tuple(src.shape)}, must be {tuple(dst.shape)}")
        dst.copy_(src)


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the last forward's ``aux_loss`` over every MoELayer in ``model``."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoELayer)]
    losses = [loss for loss in losses if loss is not None]
    if not losses:
        return torch.zeros(())
    return torch.stack(losses).sum()


def is_expert_param(param: torch.Tensor) -> bool:
    """True for parameters sharded over the EP group (keep them out of the EP all-reduce)."""
    return bool(getattr(param, "_moesaic_expert", False))
