"""MoEGPT: a decoder-only, pre-norm, byte-level transformer with MoE feed-forward blocks.

Shape legend: B sequences, T positions, D model width, V vocabulary (256 bytes), N heads,
d head width (D / N), F dense feed-forward width.

Model math only: where the experts live is decided by the expert-parallel process group handed
to the constructor (``ep_group``); the data-parallel gradient rules live in
``moesaic.train.parallel``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from moesaic.layer import MoELayer
from moesaic.models.block_model import SharedLMMethods
from moesaic.models.config import MoEGPTConfig

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec

__all__ = ["Block", "MoEGPT", "MoEGPTConfig"]


def make_norm(cfg: MoEGPTConfig) -> nn.Module:
    """The pre-norm of ``cfg.norm``: RMSNorm (no bias) or LayerNorm."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=1e-5)
    return nn.LayerNorm(cfg.d_model)


def rope_tables(seq_len: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """``[2, T, d/2]``: cos and sin of position t times frequency ``base ** (-2i / d)``."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles_Tf = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return torch.stack([angles_Tf.cos(), angles_Tf.sin()]).float()


def apply_rope(x_BNTd: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of every position t by its angles (GPT-NeoX layout)."""
    T = x_BNTd.shape[-2]
    cos_Tf, sin_Tf = table[0, :T].to(x_BNTd.dtype), table[1, :T].to(x_BNTd.dtype)
    x1, x2 = x_BNTd.chunk(2, dim=-1)
    return torch.cat([x1 * cos_Tf - x2 * sin_Tf, x2 * cos_Tf + x1 * sin_Tf], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: MoEGPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # Derived from the shape, so not saved (persistent=False): the checkpoint keys stay.
        table = None
        if cfg.positions == "rope":
            table = rope_tables(cfg.seq_len, cfg.d_model // cfg.n_heads)
        self.rope: torch.Tensor | None
        self.register_buffer("rope", table, persistent=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        N = self.n_heads
        q_BTD, k_BTD, v_BTD = self.qkv(x_BTD).split(D, dim=-1)
        q_BNTd, k_BNTd, v_BNTd = (
            t.view(B, T, N, D // N).transpose(1, 2) for t in (q_BTD, k_BTD, v_BTD)
        )
        if self.rope is not None:
            q_BNTd, k_BNTd = apply_rope(q_BNTd, self.rope), apply_rope(k_BNTd, self.rope)
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


_Stage = TypeVar("_Stage", bound=Callable[..., Any])


def _under_autocast(stage: _Stage) -> _Stage:
    """Run a ``Block`` stage under ``torch.autocast`` to the block's ``autocast_dtype`` (if
    set) on the device of its first tensor argument."""

    @functools.wraps(stage)
    def run(self: Block, x_BTD: torch.Tensor, *rest: Any) -> Any:
        if self.autocast_dtype is None:
            return stage(self, x_BTD, *rest)
        with torch.autocast(x_BTD.device.type, dtype=self.autocast_dtype):
            return stage(self, x_BTD, *rest)

    return cast(_Stage, run)


class Block(nn.Module):
    """Pre-norm block: ``x + attn(ln(x))``, then ``x + ffn(ln(x))`` (MoE or dense).

    The two halves are separate stages so that a training-step schedule can interleave them
    across microbatch chunks (FlowMoE's block pipeline): ``attention_stage`` (attention, then the
    norm that feeds the MoE gate) and ``expert_stage`` (the MoE layer: gate, dispatch, experts,
    combine, or the dense MLP). ``forward`` is exactly ``expert_stage(*attention_stage(x))``.

    With ``autocast_dtype`` set (``MoEGPT.set_autocast``) both stages run under
    ``torch.autocast`` to it: the weights stay fp32 (the master copy), the matmuls and the
    experts compute in it, the MoE router in fp32 (``Router.scores``).
    """

    autocast_dtype: torch.dtype | None = None

    def __init__(
        self,
        cfg: MoEGPTConfig,
        dense: bool,
        ep_group: dist.ProcessGroup | None,
        topology: ClusterSpec | None = None,
    ) -> None:
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = make_norm(cfg)
        if dense:
            self.mlp = DenseMLP(cfg.d_model, cfg.dense_hidden or 4 * cfg.d_model)
        else:
            self.moe = MoELayer(cfg.moe, group=ep_group, topology=topology)

    def attention_stage(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention half: returns the residual stream and the normed input of the FFN stage.

        An MoE layer's shared experts (``num_shared_experts``) run here and join the returned
        residual stream: they need no communication, so a pipelined schedule computes them
        with the gate, while other chunks' routed rows travel (FlowMoE's ``AT`` stage).

        The stages are entry points for the schedules that call them apart (FSDP2 registers
        them as forward methods, ``train/fsdp.py``: each call gathers the block and reshards
        it after); ``forward`` runs the same bodies without them, so a whole-block call is
        one gather, not one per stage.
        """
        return self._attention(x_BTD)

    def expert_stage(self, x_BTD: torch.Tensor, h_BTD: torch.Tensor) -> torch.Tensor:
        """FFN half: the residual stream plus the dense MLP's or the MoE layer's routed
        experts' output on ``h`` (its shared experts ran in ``attention_stage``)."""
        return self._ffn(x_BTD, h_BTD)

    @_under_autocast
    def _attention(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD))
        h_BTD = self.ln2(x_BTD)
        moe = getattr(self, "moe", None)
        shared_BTD = moe.shared_output(h_BTD) if moe is not None else None
        if shared_BTD is not None:
            x_BTD = x_BTD + shared_BTD
        return x_BTD, h_BTD

    @_under_autocast
    def _ffn(self, x_BTD: torch.Tensor, h_BTD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "mlp"):
            return x_BTD + self.mlp(h_BTD)
        return x_BTD + self.moe.run_experts(self.moe.route(h_BTD))

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self._ffn(*self._attention(x_BTD))

    def recompute_contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """The contexts of the first forward and of its recomputation under activation
        checkpointing (``checkpoint``'s ``context_fn``): the MoE layer's recomputation adds no
        aux terms or statistics a second time."""
        inner = self.moe.recomputation() if hasattr(self, "moe") else contextlib.nullcontext()
        return contextlib.nullcontext(), inner


class MoEGPT(SharedLMMethods):
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

    Attributes:
        activation_checkpointing: in training forwards with gradient, keep only each block's
            input and recompute the block in the backward (``torch.utils.checkpoint``,
            non-reentrant, no early stop, so every rank repeats the block's all-to-alls in the
            same order). The MoE layers add a recomputed forward's aux terms and statistics
            once. Only ``forward`` checkpoints: the pipelined schedules call the stages.
    """

    activation_checkpointing: bool = False

    def __init__(
        self,
        config: MoEGPTConfig,
        ep_group: dist.ProcessGroup | None = None,
        topology: ClusterSpec | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        if config.positions == "learned":
            self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config, not config.is_moe_block(i), ep_group, topology)
            for i in range(config.n_layers)
        )
        self.ln_f = make_norm(config)
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
        """The residual stream entering the first block: byte embeddings (plus learned position
        embeddings with ``positions = "learned"``; rotary positions act inside attention).

        ``embed`` and ``head`` are entry points for the schedules that pipeline blocks (FSDP2
        registers them as forward methods); ``forward`` runs their bodies without them, so
        the root is gathered once for the whole call (as ``Block.forward``)."""
        return self._embed(idx_BT)

    def head(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` from the last block's output (tied byte embedding)."""
        return self._head(x_BTD)

    def _embed(self, idx_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.shape[-1]
        if self.config.seq_len < T:
            raise ValueError(f"sequence length ({T}) must be <= seq_len ({self.config.seq_len})")
        x_BTD = self.tok_emb(idx_BT)
        if self.config.positions == "learned":
            x_BTD = x_BTD + self.pos_emb(torch.arange(T, device=idx_BT.device))
        return x_BTD

    def _head(self, x_BTD: torch.Tensor) -> torch.Tensor:
        # in the root's dtype (fp32), whatever the blocks computed in (FSDP2's bf16 policy
        # hands back bf16 blocks' outputs)
        x_BTD = x_BTD.to(self.tok_emb.weight.dtype)
        return F.linear(self.ln_f(x_BTD), self.tok_emb.weight)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of the next byte at every position of ``idx_BT`` (int64).

        ``head(blocks(embed(idx)))``; schedules that pipeline blocks call the stages directly.
        """
        x_BTD = self._embed(idx_BT)
        for block in self.blocks:
            x_BTD = self._run_block(block, x_BTD)
        return self._head(x_BTD)

    def _run_block(self, block: nn.Module, x_BTD: torch.Tensor) -> torch.Tensor:
        if not (self.activation_checkpointing and self.training and torch.is_grad_enabled()):
            return block(x_BTD)
        assert isinstance(block, Block)
        with set_checkpoint_early_stop(False):
            out = checkpoint(block, x_BTD, use_reentrant=False, context_fn=block.recompute_contexts)
        assert isinstance(out, torch.Tensor)
        return out

    def dense_modules(self) -> list[nn.Module]:
        """Each block's norms, attention and dense MLP, and the final norm."""
        parts = ("ln1", "attn", "ln2", "mlp")
        out = [getattr(b, n) for b in self.blocks for n in parts if hasattr(b, n)]
        return [*out, self.ln_f]

    def set_autocast(self, dtype: torch.dtype | None) -> None:
        """Run the blocks under ``torch.autocast`` to ``dtype`` (None: off); weights stay as
        they are (fp32 master weights), the embedding, final norm, head and MoE routers compute
        in fp32."""
        for block in self.blocks:
            assert isinstance(block, Block)
            block.autocast_dtype = dtype
        for _, layer in self.moe_layers():
            layer.autocast_dtype = dtype
