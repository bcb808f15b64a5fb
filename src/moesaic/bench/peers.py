"""Other libraries' MoE layers as peers of ``moesaic bench layer``, built from our weights.

A peer is built from one of our layers (``MoELayer``) so that it holds exactly the same router
and expert weights and routes exactly the same way; its forward and backward are checked against
the matching moesaic layer (``counterpart``) before anything is timed. Peers are optional: a
peer whose package is not importable is refused with its install line (see
docs/performance.md), and nothing here imports a peer's package before it is asked for.

* ``torchtitan`` (0.3.0): ``torchtitan.models.common.moe.MoE`` with its ``AllToAllTokenDispatcher``
  (over a gloo device mesh at EP > 1), softmax router with ``route_norm``, no load-balancing
  bias. Its experts cast to bf16 for the grouped GEMMs; the peer runs them in the activations'
  dtype (fp32 here), as ours do. Our shared experts (``num_shared_experts``, one fused SwiGLU
  of width S*Fs) become its ``shared_experts`` ``FeedForward`` of that width (a
  ``SigmoidGatedFeedForward`` with ``shared_expert_gate``), weights transposed to its
  ``nn.Linear`` layout; the check covers their gradients too. Counterpart: ``dropless``.
* ``deepspeed`` (0.19.8): ``deepspeed.moe.layer.MoE`` with SwiGLU experts (``w2(silu(w1 x) *
  w3 x)``, no biases), top-2 gating without random token selection or second-expert sampling,
  capacity ``ceil(cf * T * K / E)`` (``min_capacity`` 1). It renormalises kept weights after a
  drop and counts first choices in its balance loss, so the counterpart is ``padded`` at the same
  capacity factor with ``renormalize_after_drop=True`` and ``balance_loss_choices="first"``.
  Its ``l_aux`` is added to the loss with our ``aux_loss_coef``. It has no shared experts (its
  ``use_residual`` is PR-MoE's learned mix, not a sum), so a layer with them is refused.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moesaic.bench.peer_names import PEERS, check_names
from moesaic.checks import check_one_of
from moesaic.config import MoEConfig
from moesaic.experts import SharedExperts
from moesaic.layer import MoELayer


def counterpart_config(name: str, config: MoEConfig, capacity_factor: float) -> MoEConfig:
    """Our layer config a peer is built from and checked against (same routing semantics)."""
    check_one_of("peer", name, PEERS)
    if name == "torchtitan":
        return dataclasses.replace(
            config, dispatcher="dropless", capacity_factor=None, options=None
        )
    return dataclasses.replace(
        config,
        dispatcher="padded",
        options=None,
        capacity_factor=capacity_factor,
        renormalize_after_drop=True,
        balance_loss_choices="first",
    )


class PeerModule(nn.Module):
    """A peer layer behind our calling convention: ``forward(x [..., H]) -> y [..., H]``.

    ``loss_terms()`` is what a user of that library adds to the loss for this layer (its
    auxiliary loss, weighted), or None.
    """

    def __init__(self, inner: nn.Module, forward: Callable, aux: Callable | None = None):
        super().__init__()
        self.inner = inner
        self._forward = forward
        self._aux = aux
        self._last_aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self._last_aux = self._forward(x)
        return y

    def loss_terms(self) -> torch.Tensor | None:
        aux, self._last_aux = self._last_aux, None
        return aux


def build_peer(name: str, layer: MoELayer, capacity_factor: float = 1.25) -> PeerModule:
    """Peer ``name`` holding ``layer``'s weights (this rank's expert shard at EP > 1).

    ``layer`` should be built from ``counterpart_config(name, ...)``; at EP > 1 every rank of the
    layer's group must call this (the peers create their own groups, collectively).
    """
    check_names((), (name,))
    if name == "torchtitan":
        return _torchtitan(layer)
    return _deepspeed(layer, capacity_factor)


def _swiglu_experts_fp32(base: type) -> type:
    """torchtitan's GroupedExperts without its bf16 casts: grouped GEMMs in the input dtype."""

    class GroupedExpertsSameDtype(base):
        def forward(self, x_RD, num_tokens_per_expert_E):
            offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
            w1, w3, w2 = (w.to(x_RD.dtype) for w in (self.w1_EFD, self.w3_EFD, self.w2_EDF))
            h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs))
            h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
            return self._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offs)

    return GroupedExpertsSameDtype


def _torchtitan(layer: MoELayer) -> PeerModule:
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.models.common import moe as tt
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    cfg = layer.config
    if cfg.activation != "swiglu" or cfg.score_func != "softmax" or not cfg.normalize_topk:
        raise ValueError("the torchtitan peer needs a softmax, normalize_topk, swiglu layer")
    H, Fh, E, e = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, layer.num_local_experts
    shared = layer.shared_experts
    config = tt.MoE.Config(
        num_experts=E,
        routed_experts=tt.RoutedExperts.Config(
            inner_experts=tt.GroupedExperts.Config(dim=H, hidden_dim=Fh, num_experts=e),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=E, top_k=cfg.top_k),
        ),
        router=tt.TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=Linear.Config(in_features=H, out_features=E),
            top_k=cfg.top_k,
            score_func="softmax",
            route_norm=True,
        ),
        load_balance_coeff=None,
        shared_experts=None if shared is None else _torchtitan_shared_config(shared),
    )
    module = config.build()
    experts = module.routed_experts.inner_experts
    assert layer.experts.w3 is not None  # swiglu, checked above
    experts.__class__ = _swiglu_experts_fp32(type(experts))
    with torch.no_grad():
        module.router.gate.weight.copy_(layer.router.weight)
        experts.w1_EFD.copy_(layer.experts.w1.transpose(1, 2))
        experts.w3_EFD.copy_(layer.experts.w3.transpose(1, 2))
        experts.w2_EDF.copy_(layer.experts.w2.transpose(1, 2))
        if shared is not None:  # ours [H, S*Fs] / [S*Fs, H]; nn.Linear's weight is [out, in]
            ffn = module.shared_experts
            ffn.w1.weight.copy_(shared.w1.t())
            ffn.w3.weight.copy_(shared.w3.t())
            ffn.w2.weight.copy_(shared.w2.t())
            if shared.gate is not None:
                ffn.gate.weight.copy_(shared.gate)
    if layer.ep_size > 1:
        from torch.distributed.device_mesh import DeviceMesh

        # Plain functional collectives over the mesh (the spmd_types path wants a registered
        # sparse mesh that only torchtitan's trainer sets up).
        tt_utils.set_spmd_backend("partial_dtensor")
        ranks = torch.distributed.get_process_group_ranks(layer.ep.group)
        mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("ep",))
        module.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
    module.train()

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, None]:
        with warnings.catch_warnings():  # its router's fp32 autocast, a no-op on CPU, warns
            warnings.filterwarnings("ignore", "In CPU autocast", UserWarning)
            return module(x.view(1, -1, H)).view(x.shape), None

    return PeerModule(module, forward)


def _torchtitan_shared_config(shared: SharedExperts):
    """torchtitan's shared-experts FFN config for ours: one SwiGLU of our fused width S*Fs
    (torchtitan's MoE models size theirs the same way), sigmoid-gated when ours is."""
    from torchtitan.models.common.feed_forward import FeedForward, SigmoidGatedFeedForward
    from torchtitan.models.common.linear import Linear

    H, Fs = shared.w1.shape
    linears = {
        "w1": Linear.Config(in_features=H, out_features=Fs),
        "w2": Linear.Config(in_features=Fs, out_features=H),
        "w3": Linear.Config(in_features=H, out_features=Fs),
    }
    if shared.gate is None:
        return FeedForward.Config(**linears)
    return SigmoidGatedFeedForward.Config(
        **linears, gate=Linear.Config(in_features=H, out_features=1)
    )


class SwiGLUExpert(nn.Module):
    """One expert as a module (DeepSpeed's ``expert`` argument): ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _deepspeed(layer: MoELayer, capacity_factor: float) -> PeerModule:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    import deepspeed
    from deepspeed.moe.layer import MoE

    cfg = layer.config
    if cfg.activation != "swiglu" or cfg.score_func != "softmax" or cfg.top_k > 2:
        raise ValueError("the deepspeed peer needs a softmax, swiglu layer with top_k <= 2")
    if layer.shared_experts is not None:
        raise ValueError("the deepspeed peer has no shared experts (num_shared_experts must be 0)")
    H, Fh, P = cfg.hidden_size, cfg.ffn_hidden_size, layer.ep_size
    if P > 1 and not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    module = MoE(
        hidden_size=H,
        expert=SwiGLUExpert(H, Fh),
        num_experts=cfg.num_experts,
        ep_size=P,
        k=cfg.top_k,
        capacity_factor=capacity_factor,
        eval_capacity_factor=capacity_factor,
        min_capacity=1,
        drop_tokens=True,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    if P > 1:  # its expert-parallel groups (created collectively); EP = 1 needs none
        module.set_deepspeed_parallelism()
    assert layer.experts.w3 is not None  # swiglu, checked above
    with torch.no_grad():
        module.deepspeed_moe.gate.wg.weight.copy_(layer.router.weight)
        for i, expert in enumerate(module.deepspeed_moe.experts.deepspeed_experts):
            expert.w1.weight.copy_(layer.experts.w1[i].t())
            expert.w3.weight.copy_(layer.experts.w3[i].t())
            expert.w2.weight.copy_(layer.experts.w2[i].t())
    module.train()
    coef = cfg.aux_loss_coef

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, l_aux, _ = module(x)
        return y, coef * l_aux

    return PeerModule(module, forward)


@dataclass(frozen=True, slots=True)
class Agreement:
    """How a peer's step compares with our counterpart's on the same input and weights."""

    max_rel_y: float
    max_rel_dx: float
    max_rel_dw: float

    @property
    def worst(self) -> float:
        return max(self.max_rel_y, self.max_rel_dx, self.max_rel_dw)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item() or 1.0
    return (a.float() - b.float()).abs().max().item() / scale


def peer_expert_grads(peer: PeerModule) -> dict[str, torch.Tensor]:
    """The peer's expert gradients in our layout (w1/w3 [e, H, F], w2 [e, F, H]), and its shared
    experts' as ``shared_experts.<name>`` (w1/w3 [H, S*Fs], w2 [S*Fs, H], gate [1, H])."""
    inner: Any = peer.inner
    if hasattr(inner, "routed_experts"):  # torchtitan
        ex = inner.routed_experts.inner_experts
        grads = {
            "w1": ex.w1_EFD.grad.transpose(1, 2),
            "w3": ex.w3_EFD.grad.transpose(1, 2),
            "w2": ex.w2_EDF.grad.transpose(1, 2),
        }
        ffn = inner.shared_experts
        if ffn is not None:
            for name in ("w1", "w3", "w2"):
                grads[f"shared_experts.{name}"] = getattr(ffn, name).weight.grad.t()
            if hasattr(ffn, "gate"):
                grads["shared_experts.gate"] = ffn.gate.weight.grad
        return grads
    experts = inner.deepspeed_moe.experts.deepspeed_experts
    return {
        name: torch.stack([getattr(x, name).weight.grad.t() for x in experts])
        for name in ("w1", "w3", "w2")
    }


def compare(
    peer: nn.Module,
    ours: MoELayer,
    x: torch.Tensor,
    g: torch.Tensor,
    step: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    expert_grads: Callable[[Any], dict[str, torch.Tensor]] = peer_expert_grads,
) -> Agreement:
    """One forward+backward of each (``step(module, x, g) -> (y, dx)``): relative max errors
    of the output, the input gradient and the expert weight gradients (vs ours; the shared
    experts' too when ``ours`` has them: ``expert_grads`` must then give them)."""
    y_p, dx_p = step(peer, x, g)
    y_o, dx_o = step(ours, x, g)
    ours_dw = {n: getattr(ours.experts, n).grad for n in ("w1", "w3", "w2")}
    if ours.shared_experts is not None:
        for n, p in ours.shared_experts.named_parameters():
            ours_dw[f"shared_experts.{n}"] = p.grad
    peer_dw = expert_grads(peer)
    dw = max(_rel(peer_dw[n], ours_dw[n]) for n in ours_dw)
    return Agreement(max_rel_y=_rel(y_p, y_o), max_rel_dx=_rel(dx_p, dx_o), max_rel_dw=dw)
