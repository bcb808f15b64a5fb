"""transformers interop: expert parallelism for transformers MoE causal LMs, and the way back.

``expert_parallel(model, group)`` replaces, in place, each sparse MoE block of a transformers
causal LM by an ``HFMoEBlock``: its router, routed experts (sharded over ``group``, any
registered strategy) and shared experts (replicated) become one ``MoELayer``; attention, norms,
embeddings, dense MLP blocks and the head stay transformers' modules. ``to_hf_state_dict(model)`` gathers the experts back into the transformers layout, so
that the plain transformers model loads what moesaic trained. The families and where their parts
live are in ``moesaic.interop.hf_families``.

Weight layouts. transformers >= 5 keeps a block's experts as ``experts.gate_up_proj`` [E, 2F, H]
(gate rows first, then up) and ``experts.down_proj`` [E, H, F]; transformers 4.x Mixtral blocks
(read by ``moe_layer_from_mixtral``) a list of experts with ``w1`` (gate), ``w3`` (up)
``nn.Linear(H, F)`` and ``w2`` ``nn.Linear(F, H)``. Ours are ``w1``/``w3`` [E, H, F] and ``w2``
[E, F, H] (row-major activations), so each is a transpose.

Losses. The model's ``loss`` stays transformers' cross-entropy; the load-balancing loss is
moesaic's (per layer, on each rank's tokens: ``moesaic.aux_loss(model)``, weighted by the
config's ``router_aux_loss_coef``), so ``output_router_logits`` is switched off: transformers'
own balance loss reads router logits that the replaced blocks no longer record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moesaic.config import MoEConfig
from moesaic.interop.hf_families import DEEPSEEK_V3_BIAS_RATE, FAMILIES, Family, family_of
from moesaic.layer import EXPERT_PARAMS, MoELayer

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec

__all__ = [
    "HFMoEBlock",
    "config_from_mixtral",
    "expert_parallel",
    "mixtral_block_from_layer",
    "moe_layer_from_mixtral",
    "to_hf_state_dict",
]


# ---- one block ----------------------------------------------------------------------------


def _block_weights(block: Any, family: Family | None = None) -> dict[str, torch.Tensor]:
    """A transformers block's router, routed and shared experts in ``MoELayer.full_state_dict``
    form (``family`` None: a Mixtral block of transformers 4.x or >= 5)."""
    router = getattr(block, family.router_attr if family else "gate")
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
            "experts module (gate_up_proj/down_proj) nor a 4.x ModuleList of w1/w2/w3 experts"
        )
    sd = {
        "router.weight": router.weight.detach(),
        "experts.w1": w1,
        "experts.w3": w3,
        "experts.w2": w2,
    }
    if family is not None and family.grouped:
        sd["router.score_bias"] = router.e_score_correction_bias.detach()
    if family is not None and family.shared_attr is not None:
        mlp = getattr(block, family.shared_attr)
        sd["shared_experts.w1"] = mlp.gate_proj.weight.detach().t()
        sd["shared_experts.w3"] = mlp.up_proj.weight.detach().t()
        sd["shared_experts.w2"] = mlp.down_proj.weight.detach().t()
        if family.shared_gate_attr is not None:
            sd["shared_experts.gate"] = getattr(block, family.shared_gate_attr).weight.detach()
    return {k: v.contiguous().clone() for k, v in sd.items()}


def _hf_block_tensors(sd: dict[str, torch.Tensor], family: Family) -> dict[str, torch.Tensor]:
    """``MoELayer.full_state_dict`` form -> the transformers >= 5 block's keys (no prefix)."""
    w1, w3, w2 = sd["experts.w1"], sd["experts.w3"], sd["experts.w2"]
    out = {
        f"{family.router_attr}.weight": sd["router.weight"],
        "experts.gate_up_proj": torch.cat([w1, w3], dim=2).transpose(1, 2),
        "experts.down_proj": w2.transpose(1, 2),
    }
    if family.grouped and "router.score_bias" in sd:  # a buffer: not among gradients
        out[f"{family.router_attr}.e_score_correction_bias"] = sd["router.score_bias"]
    if family.shared_attr is not None:
        mlp = family.shared_attr
        out[f"{mlp}.gate_proj.weight"] = sd["shared_experts.w1"].t()
        out[f"{mlp}.up_proj.weight"] = sd["shared_experts.w3"].t()
        out[f"{mlp}.down_proj.weight"] = sd["shared_experts.w2"].t()
        if family.shared_gate_attr is not None:
            out[f"{family.shared_gate_attr}.weight"] = sd["shared_experts.gate"]
    return {k: v.contiguous() for k, v in out.items()}


def _is_silu(block: nn.Module) -> bool:
    experts = block.experts
    act = getattr(experts, "act_fn", None)
    if act is None and isinstance(experts, nn.ModuleList) and len(experts):
        act = getattr(experts[0], "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _block_config(block: nn.Module, family: Family | None, fields: dict[str, Any]) -> MoEConfig:
    """The MoEConfig of a transformers block, read from its modules (``fields`` win)."""
    if not _is_silu(block):
        raise ValueError(
            f"{type(block).__name__}: only experts with a SiLU activation (SwiGLU) convert"
        )
    jitter = getattr(block, "jitter_noise", 0.0) or 0.0
    if jitter > 0:
        raise ValueError(
            f"{type(block).__name__} has router_jitter_noise {jitter}: MoELayer's router has no "
            "input jitter; set router_jitter_noise to 0 in the transformers config"
        )
    sd = _block_weights(block, family)
    router = getattr(block, family.router_attr if family else "gate")
    E, H = sd["router.weight"].shape
    base: dict[str, Any] = {
        "hidden_size": H,
        "ffn_hidden_size": sd["experts.w1"].shape[2],
        "num_experts": E,
        "top_k": int(getattr(router, "top_k", None) or getattr(block, "top_k")),  # noqa: B009
        # Mixtral renormalises always; Granite-MoE's softmax over the top-k logits is the same.
        "normalize_topk": bool(getattr(router, "norm_topk_prob", True)),
        "score_func": family.score_func if family else "softmax",
        "activation": "swiglu",
        "z_loss_coef": 0.0,
    }
    if family is not None and family.shared_attr is not None:
        S = 1 if family.shared_count_key is None else getattr(block.config, family.shared_count_key)
        base["num_shared_experts"] = S
        base["shared_expert_hidden_size"] = sd["shared_experts.w1"].shape[1] // S
        base["shared_expert_gate"] = family.shared_gate_attr is not None
    if family is not None and family.grouped:
        base["num_expert_groups"] = router.num_group
        base["topk_groups"] = router.topk_group
        base["routed_scaling_factor"] = float(router.routed_scaling_factor)
        base["score_bias_update_rate"] = DEEPSEEK_V3_BIAS_RATE
    base.update(fields)
    config = MoEConfig(**base)
    dropped_bias = family is not None and family.grouped and config.score_bias_update_rate == 0
    if dropped_bias and sd["router.score_bias"].any():
        raise ValueError(
            f"{type(block).__name__} has a nonzero e_score_correction_bias, which the "
            "router keeps only with score_bias_update_rate > 0"
        )
    return config


def _layer_from_block(
    block: nn.Module,
    family: Family | None,
    group: dist.ProcessGroup | None,
    fields: dict[str, Any],
    topology: ClusterSpec | None = None,
) -> MoELayer:
    config = _block_config(block, family, fields)
    layer = MoELayer(config, group=group, topology=topology)
    sd = _block_weights(block, family)
    if config.score_bias_update_rate == 0:
        sd.pop("router.score_bias", None)  # zero (checked): the router has no bias then
    layer.load_full_state_dict(sd)
    ref = next(block.get_submodule("experts").parameters())  # the model's dtype
    layer = layer.to(device=ref.device, dtype=ref.dtype)
    if layer.router.score_bias is not None:  # fp32 whatever the model's dtype, as the router
        layer.router.score_bias = layer.router.score_bias.float()
    return layer


def config_from_mixtral(block: nn.Module, **overrides: Any) -> MoEConfig:
    """The MoEConfig equivalent to a Mixtral sparse-MoE block (overrides win)."""
    return _block_config(block, None, overrides)


def moe_layer_from_mixtral(
    block: nn.Module, group: dist.ProcessGroup | None = None, **overrides: Any
) -> MoELayer:
    """Build a MoELayer computing what ``block`` computes (in eval mode: no router jitter).

    Args:
        block: a transformers ``MixtralSparseMoeBlock`` (transformers 4.x or >= 5 layout).
        group: expert-parallel group; each rank keeps its shard of the experts.
        **overrides: MoEConfig fields to change (dispatcher, capacity_factor, ...).
    """
    return _layer_from_block(block, None, group, overrides)


# ---- a whole model ------------------------------------------------------------------------


class HFMoEBlock(nn.Module):
    """What ``expert_parallel`` puts in place of a transformers sparse-MoE block: its router,
    routed experts (sharded over the expert-parallel group) and shared experts (replicated) as
    one ``MoELayer``, ``moe``. Takes and returns [..., H], as the replaced block did; remembers
    its family, so that ``to_hf_state_dict`` writes the block's transformers keys back.
    """

    def __init__(self, moe: MoELayer, family: Family) -> None:
        super().__init__()
        self.moe = moe
        self.family = family

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)


def expert_parallel(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    topology: ClusterSpec | None = None,
    **overrides: Any,
) -> nn.Module:
    """Replace, in place, every sparse-MoE block of a transformers causal LM by an ``HFMoEBlock``.

    Supported ``model_type``s: ``moesaic.interop.hf_families.FAMILIES`` (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE, Granite-MoE, DeepSeek-V3); any other is refused by name (with the reason
    for those in ``REFUSED``: GPT-OSS, PhiMoE, ...). Every rank of ``group`` must call it on the
    same model (same weights: seed alike), as for any replicated model; each keeps its experts.
    DeepSeek-V3's ``e_score_correction_bias`` becomes the router's ``score_bias``, which needs
    ``score_bias_update_rate > 0`` (default 1e-3; only ``update_score_bias`` moves it).

    Args:
        model: a transformers ``*ForCausalLM`` (or its base model).
        group: the expert-parallel group; None: the default world when torch.distributed is
            initialised, else one process holding every expert.
        topology: the cluster description, for strategies that plan by the network
            (``hybrid``'s levels), as ``MoELayer`` takes it.
        **overrides: ``MoEConfig`` fields for every converted block (``dispatcher``,
            ``capacity_factor``, ``aux_loss_coef`` (default: the config's
            ``router_aux_loss_coef``), ``z_loss_coef`` (default 0), ...).

    Returns:
        ``model``, converted.
    """
    config = getattr(model, "config", None)
    family = family_of(getattr(config, "model_type", None) or type(model).__name__)
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ == family.block_class]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} ({family.model_type}) has no {family.block_class} to "
            "convert (already converted by expert_parallel?)"
        )
    fields = {"aux_loss_coef": float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)}
    fields.update(overrides)
    for name, block in blocks:
        layer = _layer_from_block(block, family, group, fields, topology)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, HFMoEBlock(layer, family))
    if config is not None and getattr(config, "output_router_logits", False):
        config.output_router_logits = False
    return model


def _full_grads(layer: MoELayer) -> dict[str, torch.Tensor]:
    """Like ``full_state_dict`` for the gradients (zeros where there is none): a collective."""

    def grad(p: torch.Tensor) -> torch.Tensor:
        return p.grad.detach() if p.grad is not None else torch.zeros_like(p)

    sd = {"router.weight": grad(layer.router.weight)}
    if layer.shared_experts is not None:
        for name, p in layer.shared_experts.named_parameters():
            sd[f"shared_experts.{name}"] = grad(p)
    slot_E = layer.placement.slot_tensor()
    for name in EXPERT_PARAMS:
        w = getattr(layer.experts, name)
        if w is not None:
            by_slot = layer.ep.all_gather_dim0(grad(w), f"gather of experts.{name} gradients")
            sd[f"experts.{name}"] = by_slot.index_select(0, slot_E.to(by_slot.device))
    return sd


def to_hf_state_dict(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The transformers state dict of a model converted by ``expert_parallel``: every expert
    gathered (a collective: every rank of each layer's group calls it; all get the same).

    Load it into the unconverted transformers model (``load_state_dict``, then
    ``save_pretrained``: plain transformers' ``from_pretrained`` reads the directory).

    Args:
        model: the converted model.
        grads: the parameters' gradients instead (zeros where a parameter has none), in the
            same layout: what a parity test compares with transformers' own gradients.
    """
    blocks = {n: m for n, m in model.named_modules() if isinstance(m, HFMoEBlock)}
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no HFMoEBlock: convert it with expert_parallel first"
        )
    inside = tuple(f"{n}.moe." for n in blocks)
    items: list[tuple[str, torch.Tensor]]
    if grads:
        items = [
            (k, p.grad.detach() if p.grad is not None else torch.zeros_like(p))
            for k, p in model.named_parameters()
        ]
    else:
        items = list(model.state_dict().items())
    out = {k: v for k, v in items if not k.startswith(inside)}
    for name, block in blocks.items():
        full = _full_grads(block.moe) if grads else block.moe.full_state_dict()
        for key, value in _hf_block_tensors(full, block.family).items():
            out[f"{name}.{key}"] = value
    return out


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
    if hasattr(block.experts, "gate_up_proj"):
        hf = _hf_block_tensors(sd, FAMILIES["mixtral"])
        block.gate.weight.copy_(hf["gate.weight"])
        block.experts.gate_up_proj.copy_(hf["experts.gate_up_proj"])
        block.experts.down_proj.copy_(hf["experts.down_proj"])
    else:
        block.gate.weight.copy_(sd["router.weight"])
        for i, expert in enumerate(block.experts):
            expert.w1.weight.copy_(sd["experts.w1"][i].t())
            expert.w3.weight.copy_(sd["experts.w3"][i].t())
            expert.w2.weight.copy_(sd["experts.w2"][i].t())
    return block.to(layer.router.weight.device)
