"""Router and RoutingPlan: which expert each token goes to, as pure data.

Shape legend: T tokens (this rank), H hidden, E experts (global), e experts per rank, K top-k,
N routed assignments that survive the capacity (N <= T*K), P ranks in the expert-parallel group,
R a leading part of the sorted assignments (R = N: the kept ones; R = T*K: all of them).

Host syncs: routing reads nothing on the host. Counts are scatter-adds, not ``bincount`` (CUDA
reads the largest id to size its output), drops are masks, not boolean indexing, and N stays on
the device: with a capacity it is data-dependent, so ``RoutingPlan.order_N`` (N entries) reads it
only when asked; the strategies take N from the split sizes they read anyway, or work on all
T*K sorted assignments (``order_TK``, a static shape).

The router computes fp32 logits whatever the activation dtype: the top-k choice is
discontinuous, and bf16 logits flip ties between ranks and runs (the reason Mixtral, DeepSeek-V3
and Megatron all route in fp32); half-precision tokens take ``router_gate.gate_logits``. Its
auxiliary losses are per-forward terms (``router_losses``). On a GPU (``kernels`` "fused",
the default there) the softmax, top-k, weights and loss statistics run in one Triton kernel
each way (``moesaic.kernels.router``: 120 -> 67 kernels a layer step on an H100, issue 27).

Capacity rule (only when ``capacity_factor`` is set): every expert keeps at most
``C = ceil(cf * T * K / E)`` assignments from this rank. Assignments are admitted first by choice
rank (all first choices before any second choice, as in GShard), then by token index; the rest
are dropped and contribute zero to the token's output (the kept weights are not renormalised).

Choice and weights (DeepSeek-V3): the top-k is chosen on ``scores + score_bias`` (the bias of
auxiliary-loss-free balancing, a buffer; none when ``score_bias_update_rate`` is 0) among the
``topk_groups`` expert groups whose two best choice scores sum highest (group-limited routing);
the combine weights are the unbiased scores of the chosen experts, normalised when
``normalize_topk``, times ``routed_scaling_factor``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moesaic.config import MoEConfig
from moesaic.kernels import KernelChoice
from moesaic.kernels import load as load_kernels
from moesaic.placement import ExpertPlacement
from moesaic.pytree import register_dataclass_node
from moesaic.router_gate import HALF_DTYPES, gate_logits
from moesaic.router_losses import AuxTerms, sequence_balance_sum, z_loss


@register_dataclass_node
@dataclass(frozen=True, slots=True, init=False)
class RoutingPlan:
    """Where each token goes. Pure data: building or reading it never communicates.

    Build it with ``build_plan``; the constructor takes ``order_TK`` (with ``num_kept`` when
    known) or, as before, just the kept assignments' ``order_N``.

    Attributes:
        topk_ids_TK: chosen global expert ids (int64), in descending score order.
        topk_weights_TK: their combine weights (fp32, in the autograd graph).
        kept_TK: False where the assignment was dropped by the capacity.
        counts_E: kept assignments per global expert (int64); sums to N.
        order_TK: flat assignment indices ``t * K + k`` sorted by dispatch slot (destination
            rank, then local expert; see ``ExpertPlacement``) and, within an expert, by token (a
            stable sort), the kept ones first: its first N entries are ``order_N``, the dropped
            ones follow (``build_plan``: T*K entries; a plan made from ``order_N`` holds only
            the kept ones). ``x_TH[order_TK[:N] // K]`` is the expert-grouped input.
        counts_Pe: kept assignments per (destination rank, local expert), the order of
            ``order_N``; ``counts_Pe.sum(1)`` are the rows sent to each rank.
        placement: which rank holds which expert.
        capacity: slots per expert, or None when dropless.
        num_kept: N when the host knows it (T*K without a capacity), else None until
            ``order_N`` reads it.
        kernels: how ``permute`` / ``unpermute`` run: "torch", or "triton" / "fused" (the
            Triton kernels of ``moesaic.kernels``): ``MoEConfig.kernels`` resolved for the
            tokens' device.
    """

    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    kept_TK: torch.Tensor
    counts_E: torch.Tensor
    order_TK: torch.Tensor
    counts_Pe: torch.Tensor
    placement: ExpertPlacement
    capacity: int | None
    num_kept: int | None
    kernels: str
    # slot maps made by ``slot_TK``, by R: the permute and the combine of one plan share one
    _slots: dict[int, torch.Tensor] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __init__(
        self,
        *,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        kept_TK: torch.Tensor,
        counts_E: torch.Tensor,
        counts_Pe: torch.Tensor,
        placement: ExpertPlacement,
        capacity: int | None,
        order_TK: torch.Tensor | None = None,
        num_kept: int | None = None,
        order_N: torch.Tensor | None = None,
        kernels: str = "torch",
    ) -> None:
        if (order_TK is None) == (order_N is None):
            raise TypeError("RoutingPlan takes exactly one of order_TK and order_N")
        if order_N is not None:
            order_TK, num_kept = order_N, order_N.numel()
        values = {
            "topk_ids_TK": topk_ids_TK,
            "topk_weights_TK": topk_weights_TK,
            "kept_TK": kept_TK,
            "counts_E": counts_E,
            "order_TK": order_TK,
            "counts_Pe": counts_Pe,
            "placement": placement,
            "capacity": capacity,
            "num_kept": num_kept,
            "kernels": kernels,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)  # frozen: the dataclass' own __init__ does so
        object.__setattr__(self, "_slots", {})

    @property
    def num_tokens(self) -> int:
        return self.topk_ids_TK.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids_TK.shape[1]

    @property
    def order_N(self) -> torch.Tensor:
        """The kept assignments, the first N of ``order_TK``. With a capacity N is known only
        on the device: the first use reads it (one host sync; remembered in ``num_kept``)."""
        if self.num_kept is None:
            object.__setattr__(self, "num_kept", int(self.counts_E.sum()))
        return self.order_TK[: self.num_kept]

    @property
    def send_counts_P(self) -> torch.Tensor:
        """Rows sent to each rank of the expert-parallel group [P]."""
        return self.counts_Pe.sum(dim=1)

    @property
    def expert_N(self) -> torch.Tensor:
        """Global expert of each expert-grouped row."""
        return self.topk_ids_TK.reshape(-1).index_select(0, self.order_N)

    def permute(self, x_TH: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """Gather tokens into expert-grouped rows: [T, H] -> [R, H].

        Args:
            x_TH: the tokens.
            rows: R, how many of the sorted assignments (``order_TK``) to gather: N (the
                default: pass it when the host knows it, e.g. from the split sizes, else it is
                read) or ``order_TK.numel()`` (all of them, the dropped after the kept: a
                static shape).
        """
        order_R = self.order_N if rows is None else self.order_TK[:rows]
        if self.kernels != "torch":
            # every row is written when all T*K assignments are (no capacity): no zero fill
            every = self.capacity is None and order_R.numel() == self.order_TK.numel()
            return load_kernels().permute(
                x_TH, self.slot_TK(order_R), order_R.numel(), zero_fill=not every
            )
        return _ReplicateTokens.apply(x_TH, order_R, self.top_k)

    def slot_TK(self, order_R: torch.Tensor) -> torch.Tensor:
        """Row of each assignment among the R of ``order_R`` (a leading part of ``order_TK``),
        -1 for the assignments past R: the slot map of the ``moesaic.kernels`` permute and
        combine [T, K]. Made once per R (the permute's and the combine's are the same map)."""
        T, K = self.topk_ids_TK.shape
        R = order_R.numel()
        every = R == T * K  # order_R a permutation: every entry is written, no fill kernel
        # Keyed -1 for "all T*K": under torch.compile R is symbolic, and looking up its value
        # in the dict would specialise it (a recompile for every token count).
        key = -1 if every else R
        if key not in self._slots:
            dev = order_R.device
            slot_TK = (
                torch.empty(T * K, dtype=torch.long, device=dev)
                if every
                else torch.full((T * K,), -1, dtype=torch.long, device=dev)
            )
            slot_TK[order_R] = torch.arange(R, device=dev)
            self._slots[key] = slot_TK.view(T, K)
        return self._slots[key]

    def unpermute(self, y_RH: torch.Tensor) -> torch.Tensor:
        """Weighted sum of expert outputs back per token: [R, H] -> [T, H].

        Row r of ``y_RH`` is the output of assignment ``order_TK[r]``: R = N gives the kept
        ones (the dropped contribute zero), R = T*K all of them (a dropped one's row must then
        be zero).

        A gather over the inverse permutation rather than a scatter-add, so the sum over the K
        choices runs in a fixed order (bitwise deterministic, and equal to the reference's
        ``sum_k w_k * y_k``).
        """
        T, K = self.topk_ids_TK.shape
        R, H = y_RH.shape
        order_R = self.order_TK[:R]
        if self.kernels != "torch":
            every = self.capacity is None and R == T * K  # every row read: no zero fill
            return load_kernels().combine(
                y_RH, self.slot_TK(order_R), self.topk_weights_TK, zero_fill=not every
            )
        if R == T * K:  # every assignment: a permutation (its backward a gather too)
            y_TKH = PermuteRows.apply(y_RH, inverse_permutation(order_R), order_R).view(T, K, H)
        else:  # the assignments past R (dropped) read a zero row appended at index R
            padded_RH = torch.cat([y_RH, y_RH.new_zeros(1, H)])
            slot_TK = torch.full((T * K,), R, dtype=torch.long, device=y_RH.device)
            slot_TK[order_R] = torch.arange(R, device=y_RH.device)
            y_TKH = padded_RH.index_select(0, slot_TK).view(T, K, H)
        # A broadcast product and a sum over K. One bmm instead ([T, 1, K] @ [T, K, H]) ran
        # slower on an H200 at K = 2 (its backward's K = 1 outer products went to a 32x32
        # wmma kernel: 1.3 ms of a 6.5 ms step), faster at K = 8; "fused" fuses it instead.
        w_TK = self.topk_weights_TK.to(y_RH.dtype)
        return (y_TKH * w_TK.unsqueeze(-1)).sum(dim=1)


def inverse_permutation(perm_N: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i`` (on the device, no host read)."""
    inverse_N = torch.empty_like(perm_N)
    inverse_N[perm_N] = torch.arange(perm_N.numel(), device=perm_N.device)
    return inverse_N


class PermuteRows(torch.autograd.Function):
    """``x.index_select(0, perm)`` for a permutation: its backward is the gather by the inverse
    permutation, not a zero fill and a scatter-add (atomic adds on a GPU) as for a general
    index_select; same values."""

    @staticmethod
    def forward(ctx, x_MH, perm_M, inverse_M):
        ctx.save_for_backward(inverse_M)
        return x_MH.index_select(0, perm_M)

    @staticmethod
    def backward(ctx, grad_MH):
        (inverse_M,) = ctx.saved_tensors
        return grad_MH.index_select(0, inverse_M), None, None


class _ReplicateTokens(torch.autograd.Function):
    """Rows ``x_TH[order_R // K]`` (token t once per assignment of it among ``order_R``).

    Backward: each token's gradient is the sum of its rows'. When ``order_R`` holds all T*K
    assignments that is a gather of each token's K rows (by the inverse permutation) and a sum
    over K: no scatter-add, so no atomic adds on a GPU (they took 1.1 ms of a 9 ms bf16 step
    at 64k rows of 2048 on an H200), and a fixed summation order. With fewer rows (the kept
    ones under a capacity) it is the index_add of a general index_select.
    """

    @staticmethod
    def forward(ctx, x_TH, order_R, K):
        ctx.save_for_backward(order_R)
        ctx.T, ctx.K = x_TH.shape[0], K
        return x_TH.index_select(0, order_R // K)

    @staticmethod
    def backward(ctx, grad_RH):
        (order_R,) = ctx.saved_tensors
        T, K = ctx.T, ctx.K
        H = grad_RH.shape[1]
        if order_R.numel() == T * K:
            rows = grad_RH.index_select(0, inverse_permutation(order_R))
            return rows.view(T, K, H).sum(dim=1), None, None
        grad_TH = grad_RH.new_zeros(T, H)
        return grad_TH.index_add_(0, order_R // K, grad_RH), None, None


def count_ids(ids: torch.Tensor, num: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """How often each id in ``[0, num)`` occurs in ``ids`` (int64 [num]), where ``mask`` holds.

    ``torch.bincount`` without its host sync: CUDA reads the largest id to size bincount's
    output, a scatter-add into ``num`` zeros does not. Integer sums: exact in any order.
    """
    ones = mask.to(torch.long) if mask is not None else torch.ones_like(ids)
    return torch.zeros(num, dtype=torch.long, device=ids.device).scatter_add_(0, ids, ones)


def _narrow_keys(keys: torch.Tensor, largest: int) -> torch.Tensor:
    """Sort keys in ``[0, largest]`` in the narrowest integer dtype that holds them: a GPU's
    radix sort makes one pass per key byte (8 for int64 expert ids, 1 for uint8). The order
    of a stable sort is the same."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if largest <= torch.iinfo(dtype).max:
            return keys.to(dtype)
    return keys


def build_plan(
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    placement: ExpertPlacement | int,
    capacity: int | None = None,
    all_counts_E: torch.Tensor | None = None,
) -> RoutingPlan:
    """Sort assignments by dispatch slot, apply the capacity, count rows per expert and rank.

    Args:
        topk_ids_TK: chosen global expert ids.
        topk_weights_TK: their combine weights.
        placement: where the experts are; an int E means all E experts on one rank.
        capacity: slots per expert (per source rank), or None for dropless.
        all_counts_E: ``count_ids`` of all of ``topk_ids_TK`` (before any drop) when the
            caller has them (the router's balance loss counts them too): not counted again.
    """
    if not isinstance(placement, ExpertPlacement):
        placement = ExpertPlacement.contiguous(placement, 1)
    num_experts = placement.num_experts
    T, K = topk_ids_TK.shape
    device = topk_ids_TK.device
    flat_ids = topk_ids_TK.reshape(-1)
    kept_flat = torch.ones(T * K, dtype=torch.bool, device=device)
    if capacity is not None:
        # Admission order: choice rank first, then token (k-major flattening).
        ids_KT = topk_ids_TK.t().reshape(-1)
        sorted_ids, perm = torch.sort(_narrow_keys(ids_KT, num_experts - 1), stable=True)
        sorted_ids = sorted_ids.long()
        counts_all = all_counts_E if all_counts_E is not None else count_ids(ids_KT, num_experts)
        starts_E = torch.cumsum(counts_all, 0) - counts_all
        rank_in_expert = torch.arange(T * K, device=device) - starts_E[sorted_ids]
        kept_KT = torch.empty_like(kept_flat)
        kept_KT[perm] = rank_in_expert < capacity
        kept_flat = kept_KT.view(K, T).t().reshape(-1)
    # Sort by dispatch slot (the expert id itself when experts sit contiguously); dropped
    # assignments sort to the end (key E), after the N kept ones.
    slots = flat_ids if placement.is_contiguous else placement.slot_tensor(device)[flat_ids]
    if capacity is None:  # every assignment kept
        keys = slots
        counts_E = all_counts_E if all_counts_E is not None else count_ids(flat_ids, num_experts)
    else:
        keys = torch.where(kept_flat, slots, torch.full_like(flat_ids, num_experts))
        counts_E = count_ids(flat_ids, num_experts, kept_flat)
    order_TK = torch.sort(_narrow_keys(keys, num_experts), stable=True).indices
    return RoutingPlan(
        topk_ids_TK=topk_ids_TK,
        topk_weights_TK=topk_weights_TK,
        kept_TK=kept_flat.view(T, K),
        counts_E=counts_E,
        order_TK=order_TK,
        num_kept=T * K if capacity is None else None,  # with a capacity: on the device only
        counts_Pe=placement.counts_Pe(counts_E),
        placement=placement,
        capacity=capacity,
    )


class Router(nn.Module):
    """Linear gate computing in fp32, with top-k selection and the auxiliary losses.

    The weight is ``[E, H]`` (like ``nn.Linear(H, E)``) and replicated on every rank, and so is
    the fp32 buffer ``score_bias`` [E] of auxiliary-loss-free balancing (None when
    ``score_bias_update_rate`` is 0): it moves only through ``update_score_bias``.
    """

    score_bias: torch.Tensor | None

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.kernel_choice = KernelChoice(config.kernels, self.weight.device)
        bias = torch.zeros(config.num_experts) if config.score_bias_update_rate > 0 else None
        self.register_buffer("score_bias", bias)

    @torch.no_grad()
    def update_score_bias(self, load_E: torch.Tensor) -> None:
        """DeepSeek-V3's update after an optimizer step: ``bias += gamma * sign(mean - load_e)``.

        ``load_E`` must be the step's assignments per expert over every rank and forward (the
        same on every rank, so every rank's bias stays the same). No-op without a bias.
        """
        if self.score_bias is None:
            return
        load_E = load_E.to(self.score_bias.device, torch.float64)
        step_E = torch.sign(load_E.mean() - load_E) * self.config.score_bias_update_rate
        self.score_bias.add_(step_E.to(self.score_bias.dtype))

    @property
    def biased_or_limited(self) -> bool:
        """Whether the top-k is chosen on more than the scores: a score bias or group limits
        (then the first choice need not be the most probable expert)."""
        cfg = self.config
        keep = cfg.topk_groups if cfg.topk_groups is not None else cfg.num_expert_groups
        return self.score_bias is not None or keep < cfg.num_expert_groups

    def choose(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """The top-k expert ids [T, K] for ``scores_TE``: on the scores plus the bias, inside
        the ``topk_groups`` best groups (their two best choice scores summed), best first."""
        cfg = self.config
        if not self.biased_or_limited:
            return torch.topk(scores_TE, cfg.top_k, dim=-1).indices
        G = cfg.num_expert_groups
        keep = cfg.topk_groups if cfg.topk_groups is not None else G
        limited = keep < G
        choice_TE = scores_TE.detach()
        if self.score_bias is not None:
            choice_TE = choice_TE + self.score_bias.to(choice_TE.dtype)
        if limited:
            T, E = choice_TE.shape
            per = E // G
            grouped_TGp = choice_TE.view(T, G, per)
            group_TG = grouped_TGp.topk(min(2, per), dim=-1).values.sum(dim=-1)
            best_TG = torch.topk(group_TG, keep, dim=-1).indices
            allowed_TG = torch.zeros(T, G, dtype=torch.bool, device=choice_TE.device)
            allowed_TG.scatter_(1, best_TG, True)
            allowed_TE = allowed_TG.repeat_interleave(per, dim=1)
            choice_TE = choice_TE.masked_fill(~allowed_TE, float("-inf"))
        return torch.topk(choice_TE, cfg.top_k, dim=-1).indices

    def logits(self, x_TH: torch.Tensor) -> torch.Tensor:
        """The gate's fp32 logits [T, E]."""
        # fp32 under autocast too (--dtype bf16), which would run this linear in bf16.
        with torch.autocast(x_TH.device.type, enabled=False):
            if x_TH.dtype in HALF_DTYPES:
                return gate_logits(x_TH, self.weight)
            return F.linear(x_TH.float(), self.weight.float())

    def scores(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits and scores (softmax probabilities or sigmoid affinities), both [T, E]."""
        logits_TE = self.logits(x_TH)
        if self.config.score_func == "softmax":
            return logits_TE, torch.softmax(logits_TE, dim=-1)
        return logits_TE, torch.sigmoid(logits_TE)

    def routes_in_one_kernel(self, num_tokens: int) -> bool:
        """Whether ``moesaic.kernels.router`` can route ``num_tokens`` tokens (given the
        kernels): softmax scores chosen on alone, the balance loss over all K choices, no
        sequence-wise loss, at least one token, and fewer than 2**24 assignments (its counts
        are fp32 sums)."""
        cfg = self.config
        return (
            cfg.score_func == "softmax"
            and not self.biased_or_limited
            and cfg.balance_loss_choices == "all"
            and cfg.seq_aux_loss_coef == 0
            and 0 < num_tokens * cfg.top_k < 2**24
        )

    def _aux(self, tokens: int, counts_E, probs_mean_E, z, top_k: int) -> AuxTerms:
        cfg = self.config
        return AuxTerms(
            tokens=tokens,
            assign_counts_E=counts_E,
            probs_mean_E=probs_mean_E,
            z=z,
            top_k=top_k,
            aux_coef=cfg.aux_loss_coef,
            z_coef=cfg.z_loss_coef,
        )

    def _route_fused(self, x_TH: torch.Tensor):
        """``_route_torch`` in the router kernels (``routes_in_one_kernel``): the gate's GEMM,
        one kernel, a sum of its blocks' statistics and the counts' int64 copy."""
        cfg = self.config
        ids_TK, weights_TK, probs_mean_E, counts_E, z = load_kernels().route(
            self.logits(x_TH), cfg.top_k, cfg.normalize_topk, cfg.routed_scaling_factor
        )
        aux = self._aux(x_TH.shape[0], counts_E, probs_mean_E, z, cfg.top_k)
        return ids_TK, weights_TK, counts_E.long(), aux

    def _route_torch(self, x_TH: torch.Tensor, seq_len: int | None):
        """Top-k ids, their weights, the assignments per expert (int64, None when the balance
        loss counts first choices only) and the aux terms, in plain torch."""
        cfg = self.config
        logits_TE, scores_TE = self.scores(x_TH)
        topk_ids_TK = self.choose(scores_TE)
        weights_TK = scores_TE.gather(1, topk_ids_TK)
        if cfg.normalize_topk:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights_TK = weights_TK * cfg.routed_scaling_factor
        # For sigmoid scores the balancing loss uses the scores normalised per token (DeepSeek-V3).
        probs_TE = scores_TE
        if cfg.score_func == "sigmoid":
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        T = x_TH.shape[0]
        # Load fractions over all K choices (Switch/Megatron) or first choices only (DeepSpeed).
        counted_ids = topk_ids_TK if cfg.balance_loss_choices == "all" else topk_ids_TK[:, :1]
        counts_E = count_ids(counted_ids.reshape(-1), cfg.num_experts)
        # The first choice is the most probable expert when chosen on the softmax alone.
        argmax = cfg.score_func == "softmax" and not self.biased_or_limited
        aux = self._aux(
            T,
            counts_E.float(),
            probs_TE.mean(dim=0) if T else probs_TE.sum(dim=0) * 0.0,
            z_loss(logits_TE, scores_TE, topk_ids_TK[:, :1]) if argmax else z_loss(logits_TE),
            counted_ids.shape[1],
        )
        if cfg.seq_aux_loss_coef > 0:
            L = seq_len if seq_len is not None else T
            seq_sum = sequence_balance_sum(probs_TE, topk_ids_TK, L)
            aux = dataclasses.replace(
                aux, seqs=T // L if L else 0, seq_sum=seq_sum, seq_coef=cfg.seq_aux_loss_coef
            )
        return topk_ids_TK, weights_TK, counts_E if counted_ids is topk_ids_TK else None, aux

    def forward(
        self,
        x_TH: torch.Tensor,
        placement: ExpertPlacement | None = None,
        seq_len: int | None = None,
    ) -> tuple[RoutingPlan, AuxTerms]:
        """Route ``x_TH`` to experts placed by ``placement`` (None: all on this rank).

        Returns the plan and this forward's aux-loss terms (``terms.loss()`` is the weighted
        load-balancing + z loss of these tokens). ``seq_len``: tokens per sequence for the
        sequence-wise loss (the T tokens are consecutive sequences); None: one sequence.
        With ``kernels`` "fused" or "triton" and where ``routes_in_one_kernel``, everything
        after the gate's GEMM runs in ``moesaic.kernels.router`` (one kernel each way, the same
        values: tests/kernels/test_kernel_router.py).
        """
        cfg = self.config
        kernels = self.kernel_choice.for_device(x_TH.device)
        if kernels != "torch" and self.routes_in_one_kernel(x_TH.shape[0]):
            topk_ids_TK, weights_TK, all_counts_E, aux = self._route_fused(x_TH)
        else:
            topk_ids_TK, weights_TK, all_counts_E, aux = self._route_torch(x_TH, seq_len)
        plan = build_plan(
            topk_ids_TK,
            weights_TK,
            placement if placement is not None else cfg.num_experts,
            capacity=cfg.capacity(x_TH.shape[0]),
            all_counts_E=all_counts_E,
        )
        if kernels != "torch":
            plan = dataclasses.replace(plan, kernels=kernels)
        if cfg.renormalize_after_drop and plan.capacity is not None:
            # Kept weights rescaled to the token's original top-k sum (DeepSpeed-MoE); a token
            # with every choice dropped keeps zero weights.
            kept_TK = weights_TK * plan.kept_TK
            scale_T = weights_TK.sum(-1, keepdim=True) / kept_TK.sum(-1, keepdim=True).clamp_min(
                1e-20
            )
            plan = dataclasses.replace(plan, topk_weights_TK=kept_TK * scale_T)
        return plan, aux
