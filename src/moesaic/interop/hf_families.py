"""Which transformers MoE families ``moesaic.interop.hf`` converts, and where their parts are.

Torch- and transformers-free: ``moesaic train --hf-config`` validates a config file with it
before any worker starts. One ``Family`` per transformers ``model_type``; the families with a
reason in ``REFUSED`` are refused with it, every other ``model_type`` by name.

Every supported family stores its routed experts the transformers >= 5 way: ``gate.weight``
(``router.weight`` for Granite-MoE) [E, H]; ``experts.gate_up_proj`` [E, 2F, H] (gate rows
first, then up) and ``experts.down_proj`` [E, H, F], a SwiGLU without biases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEEPSEEK_V3_BIAS_RATE",
    "FAMILIES",
    "FIXED_MOE_FIELDS",
    "REFUSED",
    "Family",
    "apply_hf_shape",
    "family_of",
    "read_hf_config",
    "training_shape",
]


@dataclass(frozen=True, slots=True)
class Family:
    """One transformers MoE family: where its block keeps each part, and which config keys give
    the ``MoEConfig`` fields (``training_shape``; ``expert_parallel`` reads the same from the
    block's modules).

    Attributes:
        model_type: transformers' ``config.model_type``.
        block_class: the class name of its sparse MoE block (the module replaced).
        router_attr: the block's router attribute (``gate`` or ``router``).
        experts_key: the config key of E, the routed experts.
        ffn_key: the config key of F, a routed expert's hidden width.
        normalize_key: the config key saying whether the top-k weights are renormalised;
            None: always (Mixtral softmax-then-renormalise, Granite-MoE softmax over the top-k
            logits: the same numbers).
        score_func: "softmax" or "sigmoid" (DeepSeek-V3).
        shared_attr: the block's dense shared-expert MLP (``gate_proj``/``up_proj``/
            ``down_proj``), None: none. It becomes the MoELayer's ``shared_experts``.
        shared_gate_attr: the block's ``Linear(H, 1)`` whose sigmoid scales the shared output
            (Qwen2-MoE), None: none.
        shared_count_key: the config key of the number of shared experts (DeepSeek-V3, each as
            wide as a routed one); None: one, as wide as ``shared_width_key`` says.
        shared_width_key: the config key of the one shared expert's width (Qwen2-MoE).
        grouped: DeepSeek-V3's router: group-limited top-k (``n_group``, ``topk_group``), the
            ``e_score_correction_bias`` on the choice and ``routed_scaling_factor``.
        dense_prefix_key: the config key of the number of leading dense blocks.
        no_pipeline: why the pipelined schedules cannot cut its decoder layers into their
            stages (``x + attn(norm(x))``, ``x + moe(norm(x))``); None: they can.
    """

    model_type: str
    block_class: str
    router_attr: str = "gate"
    experts_key: str = "num_experts"
    ffn_key: str = "intermediate_size"
    normalize_key: str | None = "norm_topk_prob"
    score_func: str = "softmax"
    shared_attr: str | None = None
    shared_gate_attr: str | None = None
    shared_count_key: str | None = None
    shared_width_key: str | None = None
    grouped: bool = False
    dense_prefix_key: str | None = None
    no_pipeline: str | None = None


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            model_type="mixtral",
            block_class="MixtralSparseMoeBlock",
            experts_key="num_local_experts",
            normalize_key=None,
        ),
        Family(
            model_type="qwen3_moe",
            block_class="Qwen3MoeSparseMoeBlock",
            ffn_key="moe_intermediate_size",
        ),
        Family(model_type="olmoe", block_class="OlmoeSparseMoeBlock"),
        Family(
            model_type="granitemoe",
            block_class="GraniteMoeMoE",
            router_attr="router",
            experts_key="num_local_experts",
            normalize_key=None,
            no_pipeline=(
                "its layers scale the embedding, the residual branches and the logits "
                "(embedding_multiplier, residual_multiplier, logits_scaling), which the "
                "pipelined stages (x + attention, x + experts) do not"
            ),
        ),
        Family(
            model_type="qwen2_moe",
            block_class="Qwen2MoeSparseMoeBlock",
            ffn_key="moe_intermediate_size",
            shared_attr="shared_expert",
            shared_gate_attr="shared_expert_gate",
            shared_width_key="shared_expert_intermediate_size",
        ),
        Family(
            model_type="deepseek_v3",
            block_class="DeepseekV3MoE",
            experts_key="n_routed_experts",
            ffn_key="moe_intermediate_size",
            score_func="sigmoid",
            shared_attr="shared_experts",
            shared_count_key="n_shared_experts",
            grouped=True,
            dense_prefix_key="first_k_dense_replace",
        ),
    )
}

# DeepSeek-V3's gamma (the paper's bias update speed for most of its training): what
# ``score_bias_update_rate`` is unless overridden, so that the router has its bias buffer.
DEEPSEEK_V3_BIAS_RATE = 1e-3

# Families looked at and refused, with what they need that MoELayer does not have.
REFUSED: dict[str, str] = {
    "gpt_oss": (
        "its experts have biases and a clamped SwiGLU (swiglu_alpha, swiglu_limit, interleaved "
        "gate/up columns) and its router a bias; MoELayer's experts are a bias-free SwiGLU/GELU"
    ),
    "phimoe": "its router is SparseMixer (sampled, jitter-masked top-2), not a top-k softmax",
    "jamba": "a hybrid Mamba model: only the MoE blocks would convert, not tested here",
    "jetmoe": "its attention is a mixture of experts too (MoA), which MoELayer does not model",
    "switch_transformers": "an encoder-decoder model, not a causal LM",
    "nllb_moe": "an encoder-decoder model, not a causal LM",
}


def family_of(model_type: str, what: str = "transformers model") -> Family:
    """The family of ``model_type``; a ValueError naming it (and why, where known) if none."""
    family = FAMILIES.get(model_type)
    if family is not None:
        return family
    supported = ", ".join(sorted(FAMILIES))
    why = REFUSED.get(model_type)
    reason = f": {why}" if why else ""
    raise ValueError(
        f"{what} of model_type {model_type!r} is not supported by moesaic's expert "
        f"parallelism{reason}; supported: {supported}"
    )


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A transformers config file (``config.json``) as a dict; a ValueError naming the file
    if it cannot be read or has no ``model_type``."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the transformers config {path}: {exc}") from None
    if not isinstance(d, dict) or not isinstance(d.get("model_type"), str):
        raise ValueError(f"transformers config {path} has no model_type (a config.json has one)")
    return d


def _key(d: dict[str, Any], key: str, path: str | Path) -> Any:
    if key not in d:
        raise ValueError(
            f"transformers config {path} lacks {key!r} ({d['model_type']} keeps its shape there; "
            "save_pretrained writes every key)"
        )
    return d[key]


def training_shape(d: dict[str, Any], path: str | Path = "<config>") -> dict[str, Any]:
    """The ``MoEGPTConfig`` fields (``moe`` a dict of ``MoEConfig`` fields) that describe the
    transformers model of config ``d``: what ``moesaic train --hf-config`` reports, checks
    (EP size, resumed checkpoints) and agrees on between ranks."""
    family = family_of(d["model_type"], what=f"transformers config {path}")
    hidden = _key(d, "hidden_size", path)
    layers = _key(d, "num_hidden_layers", path)
    ffn = _key(d, family.ffn_key, path)
    normalize = True if family.normalize_key is None else d.get(family.normalize_key)
    if not isinstance(normalize, bool):
        raise ValueError(f"transformers config {path} lacks {family.normalize_key!r} (a bool)")
    moe = {
        "hidden_size": hidden,
        "ffn_hidden_size": ffn,
        "num_experts": _key(d, family.experts_key, path),
        "top_k": _key(d, "num_experts_per_tok", path),
        "normalize_topk": normalize,
        "score_func": family.score_func,
        "activation": "swiglu",
        "aux_loss_coef": float(d.get("router_aux_loss_coef") or 0.0),
        "z_loss_coef": 0.0,
        # no shared experts, no groups: said, so that a run's option saying otherwise is refused
        "num_shared_experts": 0,
        "shared_expert_hidden_size": None,
        "shared_expert_gate": False,
        "num_expert_groups": 1,
        "topk_groups": None,
        "routed_scaling_factor": 1.0,
    }
    if family.shared_attr is not None:
        count = 1 if family.shared_count_key is None else _key(d, family.shared_count_key, path)
        width = ffn if family.shared_width_key is None else _key(d, family.shared_width_key, path)
        moe |= {"num_shared_experts": count, "shared_expert_hidden_size": width}
        moe["shared_expert_gate"] = family.shared_gate_attr is not None
    if family.grouped:
        moe["num_expert_groups"] = _key(d, "n_group", path)
        moe["topk_groups"] = _key(d, "topk_group", path)
        moe["routed_scaling_factor"] = float(_key(d, "routed_scaling_factor", path))
        moe["score_bias_update_rate"] = DEEPSEEK_V3_BIAS_RATE
    return {
        "vocab_size": _key(d, "vocab_size", path),
        "d_model": hidden,
        "n_layers": layers,
        "n_heads": _key(d, "num_attention_heads", path),
        "dense_layers": _dense_layers(d, layers, family),
        "norm": "rmsnorm",  # every supported family's
        "positions": "rope",
        "moe": moe,
    }


# MoE fields the transformers model fixes; the others (aux_loss_coef, z_loss_coef) are defaults
# that the run's own options override.
FIXED_MOE_FIELDS = (
    "hidden_size",
    "ffn_hidden_size",
    "num_experts",
    "top_k",
    "normalize_topk",
    "score_func",
    "activation",
    "num_shared_experts",
    "shared_expert_hidden_size",
    "shared_expert_gate",
    "num_expert_groups",
    "topk_groups",
    "routed_scaling_factor",
)


def apply_hf_shape(
    model: dict[str, Any], path: str | Path, *, vocab_size: int | None = None
) -> dict[str, Any]:
    """A ``[model]`` dict with the shape of the transformers config at ``path`` filled in
    (its ``vocab_size`` replaced by ``vocab_size`` when given: a tokenizer's).

    A shape field the dict already holds must agree (a ValueError names it and both values):
    under ``--hf-config`` the transformers config gives the model's shape; ``seq_len``, the
    strategy and the loss weights stay the run's.
    """
    shape = training_shape(read_hf_config(path), path)
    if vocab_size is not None:
        shape["vocab_size"] = vocab_size
    moe_shape = shape.pop("moe")
    out = dict(model)
    moe = dict(out.get("moe") or {})

    def agree(where: str, given: Any, want: Any) -> None:
        if given != want:
            raise ValueError(
                f"model.{where} ({given!r}) differs from the transformers config {path} "
                f"({want!r}): with --hf-config that file gives the model's shape"
            )

    for key, value in shape.items():
        if key in out:
            agree(key, out[key], value)
        out[key] = value
    for key, value in moe_shape.items():
        if key in FIXED_MOE_FIELDS and key in moe:
            agree(f"moe.{key}", moe[key], value)
        if key in FIXED_MOE_FIELDS or key not in moe:
            moe[key] = value
    out["moe"] = moe
    return out


def _dense_layers(d: dict[str, Any], layers: int, family: Family) -> int:
    """How many blocks are dense (the training run's shape record, not where they are):
    DeepSeek-V3's first ``first_k_dense_replace``, Qwen's ``mlp_only_layers`` and the blocks
    ``decoder_sparse_step`` skips."""
    if family.dense_prefix_key is not None:
        return min(layers, int(d.get(family.dense_prefix_key) or 0))
    only = set(d.get("mlp_only_layers") or ())
    step = int(d.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(layers) if i in only or (i + 1) % step)
