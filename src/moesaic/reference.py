"""An obviously-correct single-process MoE, the yardstick every fast path is tested against.

No dispatcher, no grouped matmul, no permutation tricks: route, then loop over experts and over
each token's choices, in the most literal way. Slow on purpose. Its parameters use the keys of
``MoELayer.full_state_dict()`` so a layer of any EP size can be compared with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moesaic.config import MoEConfig


class _Holder(nn.Module):
    """A bare container so parameter names read ``router.weight``, ``experts.w1``, ..."""


class ReferenceMoE(nn.Module):
    """Single-process MoE FFN over all E experts.

    ``forward(x)`` returns ``(y, aux)`` where aux is the weighted load-balancing + z-loss of the
    tokens in ``x`` (call it once per rank's batch to mirror an EP layer, whose aux loss is
    computed on that rank's tokens). ``forward(x, balance_x)``: the balance loss' load
    fractions count the choices of the tokens ``balance_x`` instead (the "global" scope: every
    rank's batch).

    Written from the papers' equations, token by token: shared experts (a sum of S SwiGLU
    FFNs, Qwen2-MoE's sigmoid gate), the bias added to the scores for the choice only and
    group-limited routing (DeepSeek-V3), the routed scaling factor (DeepSeek-V2/V3) and the
    sequence-wise balance loss (DeepSeek-V3, Eqs. 17-20).
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        E, H, Fh = config.num_experts, config.hidden_size, config.ffn_hidden_size
        self.router = _Holder()
        self.router.weight = nn.Parameter(torch.zeros(E, H))
        self.experts = _Holder()
        self.experts.w1 = nn.Parameter(torch.zeros(E, H, Fh))
        self.experts.w2 = nn.Parameter(torch.zeros(E, Fh, H))
        if config.activation == "swiglu":
            self.experts.w3 = nn.Parameter(torch.zeros(E, H, Fh))
        if config.score_bias_update_rate > 0:
            self.router.register_buffer("score_bias", torch.zeros(E))
        if config.num_shared_experts:
            S = config.shared_hidden
            self.shared_experts = _Holder()
            self.shared_experts.w1 = nn.Parameter(torch.zeros(H, S))
            self.shared_experts.w3 = nn.Parameter(torch.zeros(H, S))
            self.shared_experts.w2 = nn.Parameter(torch.zeros(S, H))
            if config.shared_expert_gate:
                self.shared_experts.gate = nn.Parameter(torch.zeros(1, H))

    @classmethod
    def from_full_state_dict(cls, config: MoEConfig, sd: dict[str, torch.Tensor]) -> ReferenceMoE:
        ref = cls(config)
        ref.load_state_dict({k: v.detach().clone() for k, v in sd.items()})
        return ref

    def expert(self, i: int, x_H: torch.Tensor) -> torch.Tensor:
        """Expert i on a batch of rows."""
        h = x_H @ self.get_parameter("experts.w1")[i]
        if self.config.activation == "swiglu":
            h = F.silu(h) * (x_H @ self.get_parameter("experts.w3")[i])
        else:
            h = F.gelu(h)
        return h @ self.get_parameter("experts.w2")[i]

    def shared(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The shared experts: ``sum_s w2_s(silu(x w1_s) * (x w3_s))``, gated by
        ``sigmoid(x g)`` (Qwen2-MoE) when configured; zeros when there are none."""
        cfg = self.config
        if not cfg.num_shared_experts:
            return torch.zeros_like(x_TH)
        w1, w3, w2 = (self.get_parameter(f"shared_experts.{n}") for n in ("w1", "w3", "w2"))
        Fs = cfg.shared_hidden // cfg.num_shared_experts
        out = torch.zeros_like(x_TH)
        for s in range(cfg.num_shared_experts):
            cols = slice(s * Fs, (s + 1) * Fs)
            out = out + (F.silu(x_TH @ w1[:, cols]) * (x_TH @ w3[:, cols])) @ w2[cols]
        if cfg.shared_expert_gate:
            out = out * torch.sigmoid(x_TH @ self.get_parameter("shared_experts.gate")[0])[:, None]
        return out

    def scores(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits and scores s_{t,e} (softmax or sigmoid), as the real router."""
        logits = F.linear(x_TH.float(), self.get_parameter("router.weight").float())
        scores = logits.softmax(-1) if self.config.score_func == "softmax" else logits.sigmoid()
        return logits, scores

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-k ids per token, token by token: on s + b (the bias, for the choice only), among
        the ``topk_groups`` groups with the largest sum of their two best s + b."""
        cfg = self.config
        T, E = scores.shape
        choice = scores.detach().clone()
        if cfg.score_bias_update_rate > 0:
            choice = choice + self.get_buffer("router.score_bias").to(choice.dtype)
        G = cfg.num_expert_groups
        keep = cfg.topk_groups if cfg.topk_groups is not None else G
        per = E // G
        ids = []
        for t in range(T):
            group_score = [
                sorted(choice[t, g * per : (g + 1) * per].tolist(), reverse=True)[:2]
                for g in range(G)
            ]
            sums = torch.tensor([sum(v) for v in group_score])
            kept_groups = set(sums.topk(keep).indices.tolist())
            allowed = [e for e in range(E) if e // per in kept_groups]
            best = sorted(allowed, key=lambda e: -choice[t, e].item())[: cfg.top_k]
            ids.append(best)
        return torch.tensor(ids, dtype=torch.long, device=scores.device).view(T, cfg.top_k)

    def route(self, x_TH: torch.Tensor, balance_x: torch.Tensor | None = None, seq_len=None):
        """Top-k ids, their weights and the aux loss (fp32, as the real router)."""
        cfg = self.config
        logits, scores = self.scores(x_TH)
        top_ids = self.choose(scores)
        weights = scores.gather(1, top_ids)
        if cfg.normalize_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights * cfg.routed_scaling_factor
        T, E = scores.shape
        if T == 0:
            return top_ids, weights, logits.sum() * 0.0
        probs = scores if cfg.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        # Switch loss, literally: E * sum_e (share of assignments to e) * (mean prob of e).
        counted_from = top_ids
        if balance_x is not None:  # global scope: the loads of every rank's tokens
            counted_from = self.choose(self.scores(balance_x.reshape(-1, x_TH.shape[1]))[1])
        counted = counted_from if cfg.balance_loss_choices == "all" else counted_from[:, :1]
        balance = sum(
            (counted == e).sum().item() / counted.numel() * probs[:, e].mean() for e in range(E)
        )
        zloss = torch.logsumexp(logits, -1).pow(2).mean()
        aux = cfg.aux_loss_coef * E * balance + cfg.z_loss_coef * zloss
        if cfg.seq_aux_loss_coef > 0:
            aux = aux + cfg.seq_aux_loss_coef * self.sequence_loss(probs, top_ids, seq_len or T)
        return top_ids, weights, aux

    def sequence_loss(self, probs: torch.Tensor, top_ids: torch.Tensor, L: int) -> torch.Tensor:
        """DeepSeek-V3's L_Bal per sequence of L tokens, then the mean over sequences:
        ``sum_i f_i P_i``, ``f_i = E / (K L) * #{t : i in topk(t)}``, ``P_i = mean_t s'_{i,t}``."""
        E, K = self.config.num_experts, self.config.top_k
        losses = []
        for b in range(probs.shape[0] // L):
            rows = slice(b * L, (b + 1) * L)
            f = [E / (K * L) * (top_ids[rows] == i).sum().item() for i in range(E)]
            losses.append(torch.stack([f[i] * probs[rows, i].mean() for i in range(E)]).sum())
        return torch.stack(losses).mean()

    def kept(self, top_ids: torch.Tensor) -> list[list[bool]]:
        """Capacity rule as written in routing.py: first choices first, then token order."""
        T, K = top_ids.shape
        cap = self.config.capacity(T)
        keep = [[True] * K for _ in range(T)]
        if cap is None:
            return keep
        used = [0] * self.config.num_experts
        for k in range(K):
            for t in range(T):
                e = int(top_ids[t, k])
                keep[t][k] = used[e] < cap
                used[e] += keep[t][k]
        return keep

    def forward(
        self, x: torch.Tensor, balance_x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        H = self.config.hidden_size
        x_TH = x.reshape(-1, H)
        seq_len = x.shape[-2] if x.dim() >= 2 else 1
        top_ids, weights, aux = self.route(x_TH, balance_x, seq_len)
        keep = self.kept(top_ids)
        if self.config.renormalize_after_drop:
            mask = torch.tensor(keep, dtype=weights.dtype, device=weights.device).view(
                weights.shape
            )
            kept_w = weights * mask
            kept_sum = kept_w.sum(-1, keepdim=True)
            # A token with every choice dropped keeps zero weights (no 0/0 in the graph).
            safe = torch.where(kept_sum > 0, kept_sum, torch.ones_like(kept_sum))
            weights = kept_w * (weights.sum(-1, keepdim=True) / safe)
        rows = [x_TH.new_zeros(H) for _ in range(x_TH.shape[0])]
        for e in range(self.config.num_experts):
            picks = [
                (t, k)
                for t in range(x_TH.shape[0])
                for k in range(self.config.top_k)
                if keep[t][k] and int(top_ids[t, k]) == e
            ]
            if not picks:
                continue
            out = self.expert(e, x_TH[[t for t, _ in picks]])
            for row, (t, k) in enumerate(picks):
                rows[t] = rows[t] + weights[t, k].to(x.dtype) * out[row]
        y = torch.stack(rows) if rows else x_TH.new_zeros(0, H)
        return (y + self.shared(x_TH)).view(x.shape), aux


def dense_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None):
    """A plain FFN (one expert, weight 1): what an E = 1, K = 1 MoE must reduce to."""
    h = x @ w1
    h = F.silu(h) * (x @ w3) if w3 is not None else F.gelu(h)
    return h @ w2
