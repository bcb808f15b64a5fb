"""MoEGPT: a decoder-only, pre-norm, byte-level transformer with MoE feed-forward blocks.

Shape legend: B sequences, T positions, D model width, V vocabulary (256 bytes), N heads,
Hd head width (D / N), F dense feed-forward width.

Model math only: where the experts live is decided by the expert-parallel process group handed
to the constructor (``ep_group``); the data-parallel gradient rules live in
``moesaic.train.parallel``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moesaic.layer import MoELayer
from moesaic.models.config import MoEGPTConfig

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec

__all__ = ["Block", "MoEGPT", "MoEGPTConfig"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: MoEGPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        N = self.n_heads
        q_BTD, k_BTD, v_BTD = self.qkv(x_BTD).split(D, dim=-1)
        q_BNTd, k_BNTd, v_BNTd = (
            t.view(B, T, N, D // N).transpose(1, 2) for t in (q_BTD, k_BTD, v_BTD)
        )
        y_BNTd = F.scaled_dot_product_attention(q_BNTd, k_BNTd, v_BNTd, is_causal=True)
        return self.proj(y_BNTd.transpose(1, 2).reshape(B, T, D))


class DenseMLP(nn.Module):
    """SwiGLU MLP for the dense blocks."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BTD)) * self.w3(x_BTD))


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + ffn(ln(x))`` (MoE or dense).

    The two halves are separate stages so that a training-step schedule can interleave them
    across microbatch chunks (FlowMoE's block pipeline): ``attention_stage`` (attention, then the
    norm that feeds the MoE gate) and ``expert_stage`` (the MoE layer: gate, dispatch, experts,
    combine, or the dense MLP). ``forward`` is exactly ``expert_stage(*attention_stage(x))``.
    """

    def __init__(
        self,
        cfg: MoEGPTConfig,
        dense: bool,
        ep_group: dist.ProcessGroup | None,
        topology: ClusterSpec | None = None,
    ) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if dense:
            self.mlp = DenseMLP(cfg.d_model, cfg.dense_hidden or 4 * cfg.d_model)
        else:
            self.moe = MoELayer(cfg.moe, group=ep_group, topology=topology)

    def attention_stage(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention half: returns the residual stream and the normed input of the FFN stage."""
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        return x_BTD, self.ln2(x_BTD)

    def expert_stage(self, x_BTD: torch.Tensor, h_BTD: torch.Tensor) -> torch.Tensor:
        """FFN half: the residual stream plus the MoE layer's (or dense MLP's) output on ``h``."""
        ffn = self.mlp if hasattr(self, "mlp") else self.moe
        return x_BTD + ffn(h_BTD)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.expert_stage(*self.attention_stage(x_BTD))


class MoEGPT(nn.Module):
    """Byte-level decoder-only transformer with MoE feed-forward blocks.

    Args:
        config: the model shape.
        ep_group: the expert-parallel process group of the MoE blocks (None: the default world
            if torch.distributed is initialised, else all experts in this process).
        topology: the cluster description of the EP group, handed to every MoE block (the
            ``hybrid`` strategy takes its levels from it); None: none.

    Initialisation draws from the default RNG in the same order whatever the EP size (the MoE
    blocks init each expert from its own seed), so seeding every rank alike gives replicated
    weights that agree and experts equal to those of an EP = 1 model.
    """

    def __init__(
        self,
        config: MoEGPTConfig,
        ep_group: dist.ProcessGroup | None = None,
        topology: ClusterSpec | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config, i < config.dense_layers, ep_group, topology)
            for i in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self._init_dense_weights()

    @torch.no_grad()
    def _init_dense_weights(self) -> None:
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers).
        # Walks modules in a fixed order, so the draws are the same at every EP size.
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 0.02)
            elif isinstance(module, nn.Linear):
                std = resid_std if name.endswith(("attn.proj", "mlp.w2")) else 0.02
                module.weight.normal_(0.0, std)

    def embed(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """The residual stream entering the first block: byte plus position embeddings."""
        T = idx_BT.shape[-1]
        if self.config.seq_len < T:
            raise ValueError(f"sequence length ({T}) must be <= seq_len ({self.config.seq_len})")
        pos_T = torch.arange(T, device=idx_BT.device)
        return self.tok_emb(idx_BT) + self.pos_emb(pos_T)

    def head(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` from the last block's output (tied byte embedding)."""
        return F.linear(self.ln_f(x_BTD), self.tok_emb.weight)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of the next byte at every position of ``idx_BT`` (int64).

        ``head(blocks(embed(idx)))``; schedules that pipeline blocks call the stages directly.
        """
        x_BTD = self.embed(idx_BT)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        return self.head(x_BTD)

    def moe_layers(self) -> list[tuple[str, MoELayer]]:
        """``(module path, layer)`` of every MoE block, in depth order."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, MoELayer)]

    @torch.no_grad()
    def generate(
        self,
        idx_BT: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled bytes to ``idx_BT`` (greedy when temperature == 0)."""
        for _ in range(max_new_tokens):
            ctx_BT = idx_BT[:, -self.config.seq_len :]
            logits_BV = self(ctx_BT)[:, -1, :].float()
            if temperature == 0:
                nxt_B1 = logits_BV.argmax(dim=-1, keepdim=True)
            else:
                logits_BV = logits_BV / temperature
                if top_k is not None:
                    kth_B1 = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1])).values[:, -1:]
                    logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
                probs_BV = torch.softmax(logits_BV, dim=-1)
                nxt_B1 = torch.multinomial(probs_BV, 1, generator=generator)
            idx_BT = torch.cat([idx_BT, nxt_B1], dim=1)
        return idx_BT
