"""The block model: what training, the pipelined schedules, checkpoints and ``moesaic generate``
use of a language model, and the part every such model shares.

Shape legend: B sequences, T positions, D model width, V vocabulary.

Two models implement :class:`BlockModel`: ``MoEGPT`` (``models/gpt.py``) and ``HFCausalLM`` (a
transformers causal LM made expert-parallel, ``models/hf_causal_lm.py``). Both inherit
:class:`SharedLMMethods`, so their MoE layers are listed and their tokens sampled by one
implementation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from moesaic.layer import MoELayer

if TYPE_CHECKING:
    from moesaic.models.config import MoEGPTConfig


@runtime_checkable
class BlockModel(Protocol):
    """A causal LM whose MoE layers are ``MoELayer`` s and whose forward splits into stages.

    ``model(idx_BT)`` gives the logits [B, T, V]; the pipelined schedules run
    ``head(blocks[...](embed(idx_BT)))`` instead, each block offering ``attention_stage`` and its
    ``moe`` layer (or none: a dense block run whole); ``config`` is the run's ``MoEGPTConfig``
    record; ``sample_vocab`` bounds the ids ``generate`` samples (None: the whole vocabulary).
    """

    config: MoEGPTConfig
    sample_vocab: int | None

    def __call__(self, idx_BT: torch.Tensor) -> torch.Tensor: ...

    def embed(self, idx_BT: torch.Tensor) -> torch.Tensor: ...

    @property
    def blocks(self) -> Any: ...  # indexable, each with attention_stage and moe

    def head(self, x_BTD: torch.Tensor) -> torch.Tensor: ...

    def moe_layers(self) -> list[tuple[str, MoELayer]]: ...

    def generate(
        self,
        idx_BT: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor: ...


class SharedLMMethods(nn.Module):
    """``moe_layers`` and ``generate`` of every block model (a mixin of ``nn.Module``).

    The subclass sets ``config`` (its ``seq_len`` is the context ``generate`` keeps) and may set
    ``sample_vocab``.
    """

    config: MoEGPTConfig
    sample_vocab: int | None = None

    def moe_layers(self) -> list[tuple[str, MoELayer]]:
        """``(module path, layer)`` of every MoE layer, in depth order."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, MoELayer)]

    def dense_modules(self) -> list[nn.Module]:
        """The modules ``compile_dense`` compiles: each block's parts that hold no MoE layer
        (norms, attention, a dense MLP) and the final norm. The subclass lists them."""
        raise NotImplementedError

    def compile_dense(self) -> None:
        """``torch.compile`` each of ``dense_modules`` in place (``nn.Module.compile``: the
        state dict keeps its keys), the way torchtitan's trainer compiles its blocks; the MoE
        layers stay eager. (Compiled alone, a dropless layer's compute is one graph,
        ``tests/test_compile.py``; whether compiling it into its block pays on a GPU is not
        measured, and at EP > 1 its exchanges' host-read split sizes break graphs.) In eager
        mode the norms, rotary
        embeddings, residual adds and casts of a bf16 step are separate kernels; fused, a
        Qwen3-MoE step on an H200 went from 191 to 156 ms of kernels
        (``benchmarks/results/gpu_train_step_h200.json``)."""
        for module in self.dense_modules():
            module.compile()

    @torch.no_grad()
    def generate(
        self,
        idx_BT: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        *,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``idx_BT`` followed by ``max_new_tokens`` sampled ids below ``sample_vocab`` (greedy
        when ``temperature`` is 0); the last ``config.seq_len`` ids are run again for every
        token. Inference keeps no aux loss and no statistics in the MoE layers."""
        for _ in range(max_new_tokens):
            logits_BV = self(idx_BT[:, -self.config.seq_len :])[:, -1, : self.sample_vocab]
            nxt_B1 = sample_next(logits_BV.float(), temperature, top_k, generator)
            idx_BT = torch.cat([idx_BT, nxt_B1], dim=1)
            for _, layer in self.moe_layers():
                layer.take_aux_loss()
                layer.take_stats()
        return idx_BT


def sample_next(
    logits_BV: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token of each sequence [B, 1]: greedy at temperature 0, else sampled from the
    softmax of ``logits / temperature`` restricted to the ``top_k`` largest (None: all)."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1, keepdim=True)
    logits_BV = logits_BV / temperature
    if top_k is not None:
        kth_B1 = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1])).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    return torch.multinomial(torch.softmax(logits_BV, dim=-1), 1, generator=generator)
