"""The router's auxiliary losses as per-forward terms (``AuxTerms``, what ``routing.Router``
returns beside its plan) and their combination into the loss of several forwards taken as one
batch (``combine_aux``, ``fold_aux``): the GShard/Switch load-balancing loss, DeepSeek-V3's
sequence-wise balance loss (``sequence_balance_sum``) and the ST-MoE z-loss (``z_loss``).

Shape legend: T tokens, E experts, K top-k, B sequences of L tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from moesaic.pytree import register_dataclass_node

__all__ = ["AuxTerms", "combine_aux", "fold_aux", "sequence_balance_sum", "z_loss"]


@register_dataclass_node
@dataclass(frozen=True, slots=True)
class AuxTerms:
    """One forward's parts of the load-balancing and z losses, before weighting.

    Kept apart (not summed into one scalar) so that several forwards of one step combine into
    exactly the loss of their tokens taken as one batch (``combine_aux``): the balance loss
    ``E * sum_e f_e * P_e`` is not linear in the tokens, so a sum of per-forward losses is not
    the batch's loss.

    Attributes:
        tokens: T of this forward.
        assign_counts_E: the T*K assignments per expert before any capacity drop (fp32,
            no gradient): numerators of f_e.
        probs_mean_E: mean router probability per expert over the T tokens (in the graph).
        z: the z-loss of these tokens (in the graph).
        top_k, aux_coef, z_coef: K and the two weights.
        seqs: sequences of this forward (for the sequence-wise loss).
        seq_sum: the sum over those sequences of each one's balance loss (in the graph), or
            None when ``seq_coef`` is 0.
        seq_coef: weight of the sequence-wise balance loss (the mean over sequences).
    """

    tokens: int
    assign_counts_E: torch.Tensor
    probs_mean_E: torch.Tensor
    z: torch.Tensor
    top_k: int
    aux_coef: float
    z_coef: float
    seqs: int = 0
    seq_sum: torch.Tensor | None = None
    seq_coef: float = 0.0

    def loss(self) -> torch.Tensor:
        """The weighted aux + z loss of this forward's tokens alone."""
        return combine_aux([self])[0]

    @property
    def requires_grad(self) -> bool:
        return self.probs_mean_E.requires_grad or self.z.requires_grad

    def detach(self) -> AuxTerms:
        return dataclasses.replace(
            self,
            probs_mean_E=self.probs_mean_E.detach(),
            z=self.z.detach(),
            seq_sum=None if self.seq_sum is None else self.seq_sum.detach(),
        )


def combine_aux(
    terms: list[AuxTerms], load: tuple[torch.Tensor, torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Per-forward loss terms whose sum is the aux + z loss of all the forwards' tokens.

    With N = sum of the forwards' T, ``f_e = sum_s counts_s[e] / (N * K)`` (all forwards' loads,
    no gradient), ``P_e = sum_s T_s * P_s[e] / N`` and ``z = sum_s T_s * z_s / N``; forward s's
    term is ``aux_coef * E * sum_e f_e * T_s * P_s[e] / N + z_coef * T_s * z_s / N``. One forward
    alone gives its own Switch balance loss and z-loss. Splitting a batch into R chunks therefore
    leaves the loss and every gradient the same (up to summation order), and each chunk's term
    stays in its own chunk's graph (a pipelined backward runs each chunk's part separately).
    The sequence-wise loss is the mean over all S sequences of the forwards: forward s adds
    ``seq_coef * seq_sum_s / S``.

    Args:
        terms: the forwards' terms.
        load: ``(counts_E, N_load)`` (N_load a 0-d tensor or [1]), the loads f_e count instead
            of the forwards' own (the global-batch scope: every rank's counts and tokens
            summed); None: the forwards' own.
    """
    if not terms:
        return []
    N = sum(t.tokens for t in terms)
    K, E = terms[0].top_k, terms[0].assign_counts_E.numel()
    if N == 0:  # no tokens anywhere: zero terms that keep the router in the graph
        return [t.probs_mean_E.sum() * 0.0 + t.z * 0.0 for t in terms]
    if load is not None:
        f_E = load[0] / (load[1].clamp_min(1) * K)
    elif len(terms) == 1:
        f_E = terms[0].assign_counts_E / (N * K)
    else:
        f_E = torch.stack([t.assign_counts_E for t in terms]).sum(dim=0) / (N * K)
    S = sum(t.seqs for t in terms)
    out = []
    for t in terms:
        share = t.tokens / N
        # the constant factors multiplied on the host: two scalar products on the device
        balance = torch.dot(f_E.to(t.probs_mean_E), t.probs_mean_E) * (t.aux_coef * E * share)
        term = balance + t.z * (t.z_coef * share)
        if t.seq_sum is not None and S:
            term = term + t.seq_coef * t.seq_sum / S
        out.append(term)
    return out


def fold_aux(a: AuxTerms, b: AuxTerms) -> AuxTerms:
    """Two forwards' terms as one (token-weighted means, summed loads): same batch loss."""
    n = a.tokens + b.tokens
    wa, wb = (a.tokens / n, b.tokens / n) if n else (0.5, 0.5)
    seq_sum = None
    if a.seq_sum is not None and b.seq_sum is not None:
        seq_sum = a.seq_sum + b.seq_sum
    return dataclasses.replace(
        a,
        tokens=n,
        assign_counts_E=a.assign_counts_E + b.assign_counts_E,
        probs_mean_E=wa * a.probs_mean_E + wb * b.probs_mean_E,
        z=wa * a.z + wb * b.z,
        seqs=a.seqs + b.seqs,
        seq_sum=seq_sum,
    )


def sequence_balance_sum(
    probs_TE: torch.Tensor, topk_ids_TK: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, summed over the T / L sequences of L tokens.

    Per sequence b: ``f_e = E / (K * L) * #{(t, k) in b : id = e}`` and ``P_e`` the mean over
    its tokens of the (per-token normalised) scores ``probs_TE``; its loss is
    ``sum_e f_e * P_e`` (1.0 at a uniform router). Only P_e carries a gradient.
    """
    T, E = probs_TE.shape
    K = topk_ids_TK.shape[1]
    if T == 0:
        return probs_TE.sum() * 0.0
    if seq_len <= 0 or T % seq_len:
        raise ValueError(f"seq_len ({seq_len}) must be > 0 and divide the tokens ({T})")
    B = T // seq_len
    ids_BM = topk_ids_TK.reshape(B, seq_len * K)
    counts_BE = torch.zeros(B, E, dtype=probs_TE.dtype, device=probs_TE.device)
    counts_BE.scatter_add_(1, ids_BM, torch.ones_like(ids_BM, dtype=probs_TE.dtype))
    f_BE = counts_BE * (E / (K * seq_len))
    P_BE = probs_TE.reshape(B, seq_len, E).mean(dim=1)
    return (f_BE * P_BE).sum()


def z_loss(
    logits_TE: torch.Tensor,
    probs_TE: torch.Tensor | None = None,
    top_T1: torch.Tensor | None = None,
) -> torch.Tensor:
    """Router z-loss (ST-MoE): mean squared log-sum-exp of the logits.

    Given the softmax ``probs_TE`` of ``logits_TE`` and each token's most probable expert
    ``top_T1`` [T, 1], the log-sum-exp is ``logit - log(prob)`` at that expert: the same value
    and gradient (``probs``) in five small kernels instead of ``torch.logsumexp``'s dozen
    (what a GPU step waits on when its host is the bound). The top probability is at least
    1/E, so its log loses nothing.
    """
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    if probs_TE is None or top_T1 is None:
        return torch.logsumexp(logits_TE, dim=-1).square().mean()
    lse_T1 = logits_TE.gather(1, top_T1) - probs_TE.gather(1, top_T1).log()
    return lse_T1.square().mean()
