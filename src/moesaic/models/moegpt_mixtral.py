"""An MoEGPT as a transformers ``MixtralForCausalLM`` computing the same logits.

MoEGPT's default block is Mixtral's: pre-norm RMSNorm (eps 1e-5), attention without biases
(the fused ``qkv`` split into ``q_proj``/``k_proj``/``v_proj``, as many key/value heads as
heads), rotary positions on channel pairs (i, i + d/2) with base 10000 (Mixtral's
``rotate_half``), a softmax router whose top-k weights are renormalised, bias-free SwiGLU
experts, a final RMSNorm and the head tied to the embedding. Options outside that block (dense
or shared experts, LayerNorm, learned positions, another router) have no Mixtral equivalent and
are refused by name. :func:`moegpt_to_mixtral` checks the converted model's logits against the
MoEGPT's on a probe batch before returning it.

Shape legend: E experts, H model width, F expert width.
"""

from __future__ import annotations

from typing import Any

import torch

from moesaic.models.gpt import MoEGPT

# MoEGPT's RMSNorm eps and rotary base (models/gpt.py).
RMS_EPS = 1e-5
ROPE_THETA = 10000.0


def _unmappable(model: MoEGPT) -> list[str]:
    """The fields of ``model``'s config a Mixtral cannot reproduce, each with its value."""
    c, moe = model.config, model.config.moe
    rules = [
        (c.norm != "rmsnorm", f"norm {c.norm!r} (Mixtral: rmsnorm)"),
        (c.positions != "rope", f"positions {c.positions!r} (Mixtral: rope)"),
        (c.dense_layers != 0, f"dense_layers {c.dense_layers} (Mixtral: every block MoE)"),
        (c.moe_layer_freq != 1, f"moe_layer_freq {c.moe_layer_freq} (Mixtral: 1)"),
        (moe.num_shared_experts != 0, f"num_shared_experts {moe.num_shared_experts}"),
        (moe.score_func != "softmax", f"score_func {moe.score_func!r} (Mixtral: softmax)"),
        (not moe.normalize_topk, "normalize_topk False (Mixtral renormalises the top-k)"),
        (moe.capacity_factor is not None, f"capacity_factor {moe.capacity_factor} (drops)"),
        (moe.activation != "swiglu", f"activation {moe.activation!r} (Mixtral: swiglu)"),
        (moe.routed_scaling_factor != 1.0, f"routed_scaling_factor {moe.routed_scaling_factor}"),
        (moe.score_bias_update_rate != 0, "a router score bias (score_bias_update_rate > 0)"),
        (moe.num_expert_groups != 1, f"num_expert_groups {moe.num_expert_groups}"),
    ]
    return [why for bad, why in rules if bad]


def mixtral_config(model: MoEGPT) -> Any:
    """The ``MixtralConfig`` of ``model``'s shape (ValueError naming what does not map)."""
    from transformers import MixtralConfig

    bad = _unmappable(model)
    if bad:
        raise ValueError(
            f"this MoEGPT has no Mixtral equivalent: {'; '.join(bad)}; only MoEGPT's default "
            "block (RMSNorm, rotary positions, every block a softmax top-k MoE) exports"
        )
    c = model.config
    return MixtralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.moe.ffn_hidden_size,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_heads,
        head_dim=c.d_model // c.n_heads,
        max_position_embeddings=c.seq_len,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        num_local_experts=c.moe.num_experts,
        num_experts_per_tok=c.moe.top_k,
        tie_word_embeddings=True,
        sliding_window=None,
        router_jitter_noise=0.0,
        output_router_logits=False,
        use_cache=False,
    )


def mixtral_state_dict(model: MoEGPT) -> dict[str, torch.Tensor]:
    """``model``'s weights under Mixtral's keys (one process holding every expert)."""
    sd = model.state_dict()
    D = model.config.d_model
    out = {
        "model.embed_tokens.weight": sd["tok_emb.weight"],
        "model.norm.weight": sd["ln_f.weight"],
    }
    out["lm_head.weight"] = sd["tok_emb.weight"]
    for i in range(model.config.n_layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = sd[b + "attn.qkv.weight"].split(D, dim=0)
        out |= {
            h + "input_layernorm.weight": sd[b + "ln1.weight"],
            h + "post_attention_layernorm.weight": sd[b + "ln2.weight"],
            h + "self_attn.q_proj.weight": q,
            h + "self_attn.k_proj.weight": k,
            h + "self_attn.v_proj.weight": v,
            h + "self_attn.o_proj.weight": sd[b + "attn.proj.weight"],
            h + "mlp.gate.weight": sd[b + "moe.router.weight"],
            # moesaic: w1, w3 [E, H, F], w2 [E, F, H]; transformers: gate_up [E, 2F, H],
            # down [E, H, F]
            h + "mlp.experts.gate_up_proj": torch.cat(
                [sd[b + "moe.experts.w1"], sd[b + "moe.experts.w3"]], dim=2
            ).transpose(1, 2),
            h + "mlp.experts.down_proj": sd[b + "moe.experts.w2"].transpose(1, 2),
        }
    return {k: t.contiguous() for k, t in out.items()}


@torch.no_grad()
def moegpt_to_mixtral(model: MoEGPT) -> Any:
    """A ``MixtralForCausalLM`` with ``model``'s weights, checked to give its logits.

    Raises:
        ValueError: the config does not map (named), or the logits of a probe batch differ
            by more than fp32 rounding (relative 1e-4 of the largest logit).
    """
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(mixtral_config(model))
    hf.load_state_dict(mixtral_state_dict(model), strict=True)
    hf.eval()
    gen = torch.Generator().manual_seed(0)
    T = min(16, model.config.seq_len)
    x_BT = torch.randint(0, model.config.vocab_size, (2, T), generator=gen)
    ours_BTV = model(x_BT).float()
    theirs_BTV = hf(input_ids=x_BT).logits.float()
    for _, layer in model.moe_layers():  # inference: drop the forward's aux loss and stats
        layer.take_aux_loss()
        layer.take_stats()
    err = float((ours_BTV - theirs_BTV).abs().max())
    scale = float(ours_BTV.abs().max())
    if err > 1e-4 * max(scale, 1.0):
        raise ValueError(
            f"the Mixtral conversion's logits differ from the MoEGPT's by {err:.3g} (largest "
            f"logit {scale:.3g}): not exact, not exported"
        )
    return hf
