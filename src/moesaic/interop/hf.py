"""transformers interop: an equivalent MoELayer from a Mixtral sparse-MoE block.

Both layouts of ``MixtralSparseMoeBlock`` are read:
- transformers >= 5: ``gate.weight`` [E, H]; ``experts.gate_up_proj`` [E, 2F, H] (gate rows
  first, then up) and ``experts.down_proj`` [E, H, F];
- transformers 4.x: ``gate`` an ``nn.Linear(H, E)``; ``experts`` a list of modules with ``w1``
  (gate), ``w3`` (up) ``nn.Linear(H, F)`` and ``w2`` ``nn.Linear(F, H)``.
Ours are ``w1``/``w3`` [E, H, F] and ``w2`` [E, F, H] (row-major activations), so each is a
transpose. Mixtral routes with a softmax over all experts, then renormalises the top-k.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moesaic.config import MoEConfig
from moesaic.layer import MoELayer


def _mixtral_weights(block: Any) -> dict[str, torch.Tensor]:
    gate = block.gate.weight.detach()
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        F = gate_up.shape[1] // 2
        w1, w3 = gate_up[:, :F].transpose(1, 2), gate_up[:, F:].transpose(1, 2)
        w2 = down.transpose(1, 2)
    elif isinstance(experts, nn.ModuleList):
        mlps: list[Any] = list(experts)
        w1 = torch.stack([e.w1.weight.detach().t() for e in mlps])
        w3 = torch.stack([e.w3.weight.detach().t() for e in mlps])
        w2 = torch.stack([e.w2.weight.detach().t() for e in mlps])
    else:
        raise ValueError(
            f"block.experts ({type(experts).__name__}) is neither a transformers>=5 "
            "MixtralExperts (gate_up_proj/down_proj) nor a 4.x ModuleList of w1/w2/w3 experts"
        )
    return {
        "router.weight": gate.clone(),
        "experts.w1": w1.contiguous().clone(),
        "experts.w3": w3.contiguous().clone(),
        "experts.w2": w2.contiguous().clone(),
    }


def _is_silu(block: nn.Module) -> bool:
    experts = block.experts
    act = getattr(experts, "act_fn", None)
    if act is None and isinstance(experts, nn.ModuleList) and len(experts):
        act = getattr(experts[0], "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def config_from_mixtral(block: nn.Module, **overrides: Any) -> MoEConfig:
    """The MoEConfig equivalent to a Mixtral sparse-MoE block (overrides win)."""
    if not _is_silu(block):
        raise ValueError("only Mixtral blocks with a SiLU expert activation (SwiGLU) convert")
    sd = _mixtral_weights(block)
    E, H, F = sd["experts.w1"].shape
    fields: dict[str, Any] = {
        "hidden_size": H,
        "ffn_hidden_size": F,
        "num_experts": E,
        "top_k": int(getattr(block, "top_k")),  # noqa: B009 (an nn.Module attribute)
        "score_func": "softmax",
        "normalize_topk": True,
        "activation": "swiglu",
        "z_loss_coef": 0.0,
    }
    fields.update(overrides)
    return MoEConfig(**fields)


def moe_layer_from_mixtral(
    block: nn.Module, group: dist.ProcessGroup | None = None, **overrides: Any
) -> MoELayer:
    """Build a MoELayer computing what ``block`` computes (in eval mode: no router jitter).

    Args:
        block: a transformers ``MixtralSparseMoeBlock``.
        group: expert-parallel group; each rank keeps its shard of the experts.
        **overrides: MoEConfig fields to change (dispatcher, capacity_factor, ...).
    """
    config = config_from_mixtral(block, **overrides)
    layer = MoELayer(config, group=group)
    layer.load_full_state_dict(_mixtral_weights(block))
    ref = next(block.parameters())
    return layer.to(device=ref.device, dtype=ref.dtype)


@torch.no_grad()
def mixtral_block_from_layer(layer: MoELayer) -> nn.Module:
    """The transformers ``MixtralSparseMoeBlock`` computing what an EP = 1 ``layer`` computes.

    Used to run the transformers block as a peer in benchmarks and to test both conversions.
    """
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = layer.config
    if layer.ep_size != 1 or cfg.activation != "swiglu" or cfg.score_func != "softmax":
        raise ValueError(
            "only an EP = 1 layer with activation='swiglu' and score_func='softmax' has a "
            "Mixtral equivalent"
        )
    if not cfg.normalize_topk or cfg.capacity_factor is not None:
        raise ValueError(
            "a Mixtral block renormalises top-k and drops nothing: "
            "normalize_topk must be True and capacity_factor None"
        )
    block: Any = MixtralSparseMoeBlock(
        MixtralConfig(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.ffn_hidden_size,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k,
        )
    )
    sd = layer.full_state_dict()
    block.gate.weight.copy_(sd["router.weight"])
    w1, w3, w2 = sd["experts.w1"], sd["experts.w3"], sd["experts.w2"]
    if hasattr(block.experts, "gate_up_proj"):
        block.experts.gate_up_proj.copy_(torch.cat([w1, w3], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(w2.transpose(1, 2))
    else:
        for i, expert in enumerate(block.experts):
            expert.w1.weight.copy_(w1[i].t())
            expert.w3.weight.copy_(w3[i].t())
            expert.w2.weight.copy_(w2[i].t())
    return block.to(layer.router.weight.device)
