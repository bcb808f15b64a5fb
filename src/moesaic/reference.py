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
    computed on that rank's tokens).
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

    def route(self, x_TH: torch.Tensor):
        """Top-k ids, their weights and the aux loss (fp32, as the real router)."""
        cfg = self.config
        logits = F.linear(x_TH.float(), self.get_parameter("router.weight").float())
        scores = logits.softmax(-1) if cfg.score_func == "softmax" else logits.sigmoid()
        top_scores, top_ids = scores.topk(cfg.top_k, dim=-1)
        weights = top_scores
        if cfg.normalize_topk:
            weights = top_scores / top_scores.sum(-1, keepdim=True)
        T, E = scores.shape
        if T == 0:
            return top_ids, weights, logits.sum() * 0.0
        probs = scores if cfg.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        # Switch loss, literally: E * sum_e (share of assignments to e) * (mean prob of e).
        counted = top_ids if cfg.balance_loss_choices == "all" else top_ids[:, :1]
        balance = sum(
            (counted == e).sum().item() / counted.numel() * probs[:, e].mean() for e in range(E)
        )
        zloss = torch.logsumexp(logits, -1).pow(2).mean()
        aux = cfg.aux_loss_coef * E * balance + cfg.z_loss_coef * zloss
        return top_ids, weights, aux

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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        H = self.config.hidden_size
        x_TH = x.reshape(-1, H)
        top_ids, weights, aux = self.route(x_TH)
        keep = self.kept(top_ids)
        if self.config.renormalize_after_drop:
            mask = torch.tensor(keep, dtype=weights.dtype).view(weights.shape)
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
        return y.view(x.shape), aux


def dense_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor | None):
    """A plain FFN (one expert, weight 1): what an E = 1, K = 1 MoE must reduce to."""
    h = x @ w1
    h = F.silu(h) * (x @ w3) if w3 is not None else F.gelu(h)
    return h @ w2
