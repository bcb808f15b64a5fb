"""A transformers causal LM, expert-parallel, as a block model (``moesaic train --hf-config``).

The model is built from the transformers config alone (random initialisation from the
caller's seed, alike on every rank; nothing is downloaded) and converted by
``moesaic.interop.hf.expert_parallel``.

The pipelined schedules (``moesaic.schedule.pipeline``) run a block model: ``embed``, ``blocks``
(each with ``attention_stage`` and an ``moe`` layer, or a dense block run whole) and ``head``.
``HFCausalLM`` offers those stages over the transformers modules themselves (the decoder
layers' norms, attention and MoE block), for the families whose layers are the plain
pre-norm ``x + attn(norm(x))``, ``x + moe(norm(x))`` (all but Granite-MoE, whose multipliers
``TrainConfig`` refuses to pipeline); a test checks that the stages compose to the forward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from moesaic.interop.hf import HFMoEBlock, expert_parallel, to_hf_state_dict
from moesaic.interop.hf_families import FIXED_MOE_FIELDS
from moesaic.layer import MoELayer
from moesaic.models.block_model import SharedLMMethods
from moesaic.models.config import MoEGPTConfig

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec


class HFCausalLM(SharedLMMethods):
    """A transformers causal LM shaped as the training loop uses a model.

    ``forward(idx_BT)`` returns the logits [B, T, V]; ``moe_layers()`` lists the MoE layers;
    ``config`` is the ``MoEGPTConfig`` the run records (its shape fields come from the
    transformers config: ``moesaic.interop.hf_families.training_shape``). The transformers model
    is ``hf``; ``moesaic.interop.hf.to_hf_state_dict(model.hf)`` gives its plain state dict.

    Args:
        hf_config: the transformers config as a dict (a ``config.json``'s contents).
        config: the run's model record; its ``moe`` fields (strategy, loss weights, timeout,
            ...) are every converted block's.
        ep_group: the expert-parallel group (None: one process holding every expert).
        topology: the cluster description, for the ``hybrid`` strategy.
    """

    def __init__(
        self,
        hf_config: dict[str, Any],
        config: MoEGPTConfig,
        ep_group: dist.ProcessGroup | None = None,
        topology: ClusterSpec | None = None,
    ) -> None:
        super().__init__()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from the config: never download
        from transformers import AutoConfig, AutoModelForCausalLM

        d = dict(hf_config)
        hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
        hf_cfg.use_cache = False
        self.hf = AutoModelForCausalLM.from_config(hf_cfg)
        # The run's options; the transformers blocks give the rest (checked equal below).
        run = {
            f.name: getattr(config.moe, f.name)
            for f in dataclasses.fields(config.moe)
            if f.name not in FIXED_MOE_FIELDS
        }
        expert_parallel(self.hf, ep_group, topology=topology, **run)
        self.config = config
        # ids a sample may take: the bytes 0-255 (byte data under any vocabulary); a token
        # run's generate sets the tokenizer's
        self.sample_vocab = 256
        for name, layer in self.moe_layers():
            for key in FIXED_MOE_FIELDS:
                mine, recorded = getattr(layer.config, key), getattr(config.moe, key)
                if mine != recorded:
                    raise ValueError(
                        f"{name}: the transformers block has {key} {mine!r}, the run's record "
                        f"(read from the config file) {recorded!r}"
                    )

    @torch.no_grad()
    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write the plain transformers model (every expert gathered: a collective; rank 0 of
        the default group, or the only process, writes) that ``from_pretrained`` reads."""
        from transformers import AutoModelForCausalLM

        sd = to_hf_state_dict(self.hf)
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        plain = AutoModelForCausalLM.from_config(self.hf.config)
        plain.load_state_dict(sd)
        plain.save_pretrained(directory)

    def dense_modules(self) -> list[torch.nn.Module]:
        """Each decoder layer's children but its MoE block (norms, attention, a dense MLP),
        and the decoder's final norm."""
        out = [
            child
            for layer in self.base.layers
            for child in layer.children()
            if not isinstance(child, HFMoEBlock)
        ]
        return [*out, self.base.norm]

    # None: fp32; else the dtype the model runs in under ``torch.autocast`` (``set_autocast``).
    autocast_dtype: torch.dtype | None = None

    def set_autocast(self, dtype: torch.dtype | None) -> None:
        """Run the model under ``torch.autocast`` to ``dtype`` (None: off); weights stay as
        they are (fp32 master weights), the MoE routers compute in fp32 (``Router.scores``).
        Unlike ``MoEGPT``'s the whole transformers forward runs under it, the head's matmul
        too (as transformers' own mixed-precision training runs it): the families' heads
        differ (a logit scale, tied weights), and their forward is what applies them."""
        self.autocast_dtype = dtype
        for _, layer in self.moe_layers():
            layer.autocast_dtype = dtype

    def autocast(self, x: torch.Tensor) -> contextlib.AbstractContextManager:
        """The ``set_autocast`` region on ``x``'s device (a null context when it is off)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(x.device.type, dtype=self.autocast_dtype)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        with self.autocast(idx_BT):
            return self.hf(input_ids=idx_BT, use_cache=False).logits

    # ---- the stages of the pipelined schedules --------------------------------------------

    @property
    def base(self) -> Any:
        """The transformers decoder (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``)."""
        return self.hf.model

    def embed(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """The residual stream entering the first decoder layer."""
        with self.autocast(idx_BT):
            return self.base.embed_tokens(idx_BT)

    @property
    def blocks(self) -> list[HFBlockStages]:
        """Each decoder layer's stages (made on access; the layers are the model's)."""
        return [HFBlockStages(self, i) for i in range(len(self.base.layers))]

    def head(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] from the last decoder layer's output."""
        with self.autocast(x_BTD):
            return self.hf.lm_head(self.base.norm(x_BTD))

    def layer_context(self, x_BTD: torch.Tensor, i: int) -> dict[str, Any]:
        """What decoder layer ``i`` takes besides its input, as the transformers forward makes
        it: rotary position embeddings, position ids and the causal (or sliding) mask."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        cfg = self.hf.config
        pos_1T = torch.arange(x_BTD.shape[1], device=x_BTD.device).unsqueeze(0)
        kinds = getattr(cfg, "layer_types", None)
        if kinds is not None:
            sliding = kinds[i] == "sliding_attention"
        else:
            sliding = getattr(cfg, "sliding_window", None) is not None
        make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
        # No position ids to the mask: with them and no attention mask, transformers looks for
        # packed sequences in them (a host sync per call, one per layer and chunk here); ours
        # are one arange, never packed, so the mask is the same without the look.
        mask = make_mask(
            config=cfg,
            inputs_embeds=x_BTD,
            attention_mask=None,
            cache=None,
            position_ids=None,
        )
        return {
            "position_embeddings": self.base.rotary_emb(x_BTD, pos_1T),
            "position_ids": pos_1T,
            "attention_mask": mask,
        }


class HFBlockStages:
    """One transformers decoder layer as a block of the pipelined schedules.

    ``attention_stage(x) -> (x + attn(norm1(x)) [+ shared experts], norm2(...))``; the schedule
    routes the second, runs ``moe``'s experts and adds them to the first (the decoder layer's
    ``x + mlp(norm2(x))``, its MoE block's shared experts moved into the attention stage as
    ``MoEGPT``'s are). A layer with a dense MLP has no ``moe`` and runs whole (``__call__``).
    Not a module: the layer stays registered where transformers put it.
    """

    def __init__(self, model: HFCausalLM, i: int) -> None:
        self.model, self.i = model, i
        self.layer = model.base.layers[i]
        mlp = getattr(self.layer, "mlp", None)
        self.moe: MoELayer | None = mlp.moe if isinstance(mlp, HFMoEBlock) else None

    def attention_stage(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self.model.autocast(x_BTD):
            return self._attention_stage(x_BTD)

    def _attention_stage(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layer, ctx = self.layer, self.model.layer_context(x_BTD, self.i)
        attn_BTD, _ = layer.self_attn(hidden_states=layer.input_layernorm(x_BTD), **ctx)
        x_BTD = x_BTD + attn_BTD
        h_BTD = layer.post_attention_layernorm(x_BTD)
        shared_BTD = self.moe.shared_output(h_BTD) if self.moe is not None else None
        return (x_BTD if shared_BTD is None else x_BTD + shared_BTD), h_BTD

    def __call__(self, x_BTD: torch.Tensor) -> torch.Tensor:
        with self.model.autocast(x_BTD):
            return self.layer(x_BTD, **self.model.layer_context(x_BTD, self.i))
