"""MoELayer: router -> dispatcher -> grouped experts -> dispatcher, the public nn.Module.

Shape legend: T tokens on this rank, H hidden, F expert hidden, E experts, e = E / P local
experts, P ranks in the expert-parallel group, M rows received for the local experts.

Expert parallelism with data parallelism: the layer only moves tokens inside its expert-parallel
group. Parameters marked ``_moesaic_expert`` (w1, w2, w3) are sharded over that group and their
gradients already hold the contributions of every rank's tokens (the combine all-to-all carries
them back), so they must be all-reduced only across replicas of the same shard (the DP
dimension), never across the EP group. The router (and everything else) is replicated: its
gradient must be all-reduced across all ranks. See docs/architecture.md. Shared experts
(``num_shared_experts``) are replicated too, and so is the router's ``score_bias`` buffer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from moesaic.comm.agree import check_ranks_agree
from moesaic.comm.collectives import EPGroup
from moesaic.config import MoEConfig
from moesaic.eager import eager_under_compile
from moesaic.experts import GroupedExperts, SharedExperts
from moesaic.placement import ExpertPlacement
from moesaic.router_losses import AuxTerms, combine_aux, fold_aux
from moesaic.routing import Router, RoutingPlan, count_ids
from moesaic.strategies import make_strategy
from moesaic.strategies.base import (
    CommStats,
    DispatchCombineStrategy,
    ExchangeHandle,
    ExpertRun,
    Outbound,
    StrategyContext,
)

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec

EXPERT_PARAMS = ("w1", "w3", "w2")
# Forwards whose aux loss was never read before a warning (a training loop that never calls
# moesaic.aux_loss(model) keeps every step's router graph alive through the pending sum).
_UNREAD_AUX_WARN = 1024
# Forwards whose aux terms the statistics keep before summing them into one tensor.
_FOLD_AUX_AT = 64


@dataclass(slots=True)
class LayerStats:
    """What the forwards of one layer did since its statistics were last taken.

    Several forwards (microbatch chunks of one step, gradient-accumulation steps, evaluation)
    add up: ``forwards`` counts them, ``counts_E`` sums the kept assignments per expert on this
    rank, ``routed_E`` all T*K assignments before any capacity drop (the load auxiliary-loss-free
    balancing corrects), ``comm`` sums the communication (``CommStats.__add__``) and
    ``aux_loss`` sums each forward's own weighted aux + z loss (detached, kept as a tensor: no
    device sync per forward; the differentiable loss of the forwards taken together is
    ``moesaic.aux_loss``). It is computed when read, from the forwards' detached terms: a
    forward adds no kernels for it (on a GPU the loss is a dozen small kernels, and their
    launches are what a host-bound step waits on).
    """

    forwards: int = 0
    tokens: int = 0
    counts_E: torch.Tensor | None = None
    comm: CommStats = field(default_factory=CommStats)
    routed_E: torch.Tensor | None = None
    aux_terms: list[AuxTerms] = field(default_factory=list)
    aux_folded: torch.Tensor | None = None  # the loss of terms folded away (``_FOLD_AUX_AT``)

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """The sum of each forward's own aux + z loss (detached); None before any forward."""
        losses = [t.loss() for t in self.aux_terms]
        if self.aux_folded is not None:
            losses.append(self.aux_folded)
        return torch.stack(losses).sum() if losses else None

    def add(
        self,
        tokens: int,
        counts_E: torch.Tensor,
        comm: CommStats,
        aux: AuxTerms,
        routed_E: torch.Tensor | None = None,
    ) -> None:
        self.forwards += 1
        self.tokens += tokens
        counts = counts_E.detach()
        self.counts_E = counts.clone() if self.counts_E is None else self.counts_E + counts
        self.aux_terms.append(aux.detach())
        if len(self.aux_terms) >= _FOLD_AUX_AT:  # statistics never read: bounded memory
            self.aux_folded, self.aux_terms = self.aux_loss, []
        self.comm = self.comm + comm
        if routed_E is not None:
            self.routed_E = routed_E if self.routed_E is None else self.routed_E + routed_E


@dataclass(frozen=True, slots=True)
class Routed:
    """The gate's result for one input: the input [..., H], its plan and its aux loss."""

    x: torch.Tensor
    plan: RoutingPlan
    aux: AuxTerms


class MoELayer(nn.Module):
    """A mixture-of-experts feed-forward layer with expert parallelism.

    Args:
        config: layer shape and behaviour; ``config.dispatcher`` names the execution strategy
            (see ``moesaic.strategies.strategy_names()``).
        group: the expert-parallel process group; None = the default world when
            torch.distributed is initialised, else a single process holding all experts.
        placement: which rank holds which expert; None = contiguous (rank p holds experts
            ``[p*e, (p+1)*e)``).
        topology: the cluster description, for strategies that plan by the network.
        balance_group: the ranks whose tokens the "global" ``balance_loss_scope`` counts (their
            load counts are all-reduced over it); None: the default world when
            torch.distributed is initialised (every rank's batch: the global batch), else this
            process. Unused with the "local" scope.

    Per-forward state adds up until it is read: every forward adds its aux-loss terms to a
    pending list that ``moesaic.aux_loss(model)`` turns into the loss of all those forwards'
    tokens taken as one batch and clears (read once per backward, after all the forwards that
    backward covers), and its load and communication to ``stats`` (``take_stats()`` returns and
    clears them).
    """

    # The rows' dtype for the strategy and experts outside an autocast region (None: the
    # input's): ``MoEGPT.set_autocast`` sets it, for the pipelined schedules' ``send``.
    autocast_dtype: torch.dtype | None = None

    def __init__(
        self,
        config: MoEConfig,
        group: dist.ProcessGroup | None = None,
        *,
        placement: ExpertPlacement | None = None,
        topology: ClusterSpec | None = None,
        balance_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.ep = EPGroup(group, config.collective_timeout_s)
        # "global" balance scope: the group whose loads the balance loss counts
        self.balance: EPGroup | None = None
        if config.balance_loss_scope == "global":
            self.balance = EPGroup(balance_group, config.collective_timeout_s)
        config.check_ep_size(self.ep.size)
        if placement is None:
            placement = ExpertPlacement.contiguous(config.num_experts, self.ep.size)
        if placement.num_experts != config.num_experts or placement.ep_size != self.ep.size:
            raise ValueError(
                f"placement is for {placement.num_experts} experts on {placement.ep_size} ranks; "
                f"the layer has num_experts ({config.num_experts}) on {self.ep.size} ranks"
            )
        if self.ep.size > 1:
            # Another num_experts or ffn size on one rank would abort gloo or run silently wrong.
            fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
            fields["placement"] = placement.experts_of_rank
            check_ranks_agree(fields, group=group, timeout_s=self.ep.timeout_s, what="MoELayer")
        self._agreed_dtypes: tuple[torch.dtype, torch.dtype] | None = None
        self.placement = placement
        self.num_local_experts = placement.num_local
        self.router = Router(config)
        self.experts = GroupedExperts(config, placement.local_experts(self.ep.rank))
        self.shared_experts = SharedExperts(config) if config.num_shared_experts else None
        ctx = StrategyContext(config, self.ep, placement, topology=topology)
        self.strategy = make_strategy(config.dispatcher, ctx)
        self.stats = LayerStats()
        self._pending_aux: list[AuxTerms] = []
        # True while activation checkpointing recomputes a forward (``recomputation``).
        self._recomputing = False
        self.reset_parameters()

    @property
    def ep_size(self) -> int:
        return self.ep.size

    def take_aux_terms(self) -> list[torch.Tensor]:
        """One loss term per pending forward (each in its own forward's graph), summing to the
        aux + z loss of all their tokens as one batch (``router_losses.combine_aux``); clears them.

        For a pipelined backward that runs each microbatch chunk's part separately; forwards
        without gradient are folded into one term.
        """
        terms, self._pending_aux = self._pending_aux, []
        return combine_aux(terms, self._global_load(terms))

    def _global_load(self, terms: list[AuxTerms]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The "global" scope's loads: the pending forwards' assignment counts and tokens summed
        over the balance group (one all-reduce; a collective every rank of it must enter).

        Only for forwards with gradient (training): evaluation forwards use their own loads and
        never communicate, so a rank may evaluate alone.
        """
        group = self.balance
        if group is None or self.config.aux_loss_coef == 0 or not terms:
            return None
        if not any(t.requires_grad for t in terms):
            return None
        # float64: counts and token totals stay exact integers (fp32 is exact only to 2**24)
        counts = torch.stack([t.assign_counts_E for t in terms]).sum(dim=0).double()
        tokens = counts.new_full((1,), float(sum(t.tokens for t in terms)))
        buf = torch.cat([counts, tokens]).to(group.control_device)
        group.all_reduce(buf, what="all_reduce of the global-batch expert loads")
        buf = buf.to(counts.device)
        return buf[:-1], buf[-1]  # no host read of the total: it stays on the device

    def take_aux_loss(self) -> torch.Tensor | None:
        """The aux + z loss of every forward since the last call as one batch (in the graph),
        or None when there was none; clears it. ``moesaic.aux_loss(model)`` calls this."""
        terms = self.take_aux_terms()
        return _sum(terms) if terms else None

    def take_stats(self) -> LayerStats:
        """The statistics of every forward since the last call; clears them."""
        stats, self.stats = self.stats, LayerStats()
        return stats

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Init from the default RNG, consuming the same draws whatever the EP size.

        The router draws its [E, H] normal weight; then one 62-bit base seed is drawn, and each
        expert's weights come from a generator seeded by (base seed, global expert id). Rank r
        at EP size k therefore holds exactly experts ``[r*e, (r+1)*e)`` of the EP = 1 layer.
        Ranks must be seeded alike (as with any replicated model).
        """
        std = self.config.init_std if self.config.init_std is not None else 0.02
        self.router.weight.normal_(0.0, std)
        base_seed = int(torch.randint(0, 2**62, (1,)).item())
        self.experts.reset_parameters(base_seed)
        if self.shared_experts is not None:  # replicated: drawn alike on every rank
            self.shared_experts.reset_parameters(std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MoE FFN to ``x`` [..., H]; returns the same shape and dtype.

        The same as ``run_experts(route(x)) + shared_output(x)``: pipelined schedules (FlowMoE's
        attention + gate stage, then the all-to-all and expert stages) call the parts
        separately (``models/gpt.py``: the shared experts join the attention stage).
        """
        routed = self._route(x)
        y, tokens, comm = self._run_strategy(routed)
        shared = self.shared_output(x)
        y = y if shared is None else y + shared
        # Last, after all the compute: under torch.compile the bookkeeping is the forward's one
        # graph break, so the layer's compute stays one graph.
        self._account(tokens, routed, comm)
        return y

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output for ``x`` [..., H] (shape and dtype of ``x``); None when
        the layer has none. No communication."""
        if self.shared_experts is None:
            return None
        H = self.config.hidden_size
        return self.shared_experts(x.reshape(-1, H)).view(x.shape)

    @torch.no_grad()
    def update_score_bias(self, load_E: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing after an optimizer step (``Router.update_score_bias``):
        ``load_E`` is the step's assignments per expert summed over every rank and forward
        (``LayerStats.routed_E`` all-reduced; ``moesaic train`` does it). No-op without a bias.
        """
        self.router.update_score_bias(load_E)

    def route(self, x: torch.Tensor) -> Routed:
        """The gate: route ``x`` [..., H] (no communication); adds its aux loss to the sum."""
        routed = self._route(x)
        self._add_aux(routed.aux)
        return routed

    def _route(self, x: torch.Tensor) -> Routed:
        """``route`` less its bookkeeping."""
        H = self.config.hidden_size
        if not torch.is_floating_point(x):
            raise ValueError(f"input must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() == 0 or x.shape[-1] != H:
            raise ValueError(
                f"input's last dimension ({x.shape[-1] if x.dim() else 'scalar'}) must equal "
                f"hidden_size ({H})"
            )
        x_TH = x.reshape(-1, H)
        # The sequence-wise loss' sequences: the second-to-last dimension (a 2-D input is one).
        seq_len = x.shape[-2] if x.dim() >= 2 else 1
        plan, aux = self.router(x_TH, self.strategy.routing_placement, seq_len=seq_len)
        return Routed(x, plan, aux)

    def run_experts(self, routed: Routed) -> torch.Tensor:
        """The strategy's communication and the experts for a routed input; output like ``x``."""
        y, tokens, comm = self._run_strategy(routed)
        self._record(tokens, routed, comm)
        return y

    def _run_strategy(self, routed: Routed) -> tuple[torch.Tensor, int, CommStats]:
        """``run_experts`` less its bookkeeping: the output like ``x``, the tokens and what the
        strategy sent (for ``_record``)."""
        x = routed.x
        x_TH = autocast_rows(x.reshape(-1, self.config.hidden_size), self.autocast_dtype)
        self._check_dtypes_agree(x_TH)
        out = self.strategy.forward(x_TH, routed.plan, self.experts)
        return out.y_TH.to(x.dtype).view(x.shape), x_TH.shape[0], out.stats

    # ---- the phases of run_experts, for pipelined schedules ---------------------------------

    def exchange_strategy(self, schedule: str | None = None) -> DispatchCombineStrategy:
        """The strategy, when it splits into the dispatch/combine phases a pipelined schedule
        runs as separate stages (``DispatchCombineStrategy``); a ValueError naming it and
        ``schedule`` (its ``supports``) if not."""
        strategy = self.strategy
        if schedule is not None:
            strategy.supports.check(strategy.name or self.config.dispatcher, schedule=schedule)
        if not isinstance(strategy, DispatchCombineStrategy):
            raise ValueError(
                f"dispatcher {self.config.dispatcher!r} ({type(strategy).__name__}) has no "
                "dispatch/combine phases (DispatchCombineStrategy), which the pipelined schedules "
                "(moe-only, flowmoe) need; use the vanilla schedule with it"
            )
        return strategy

    def prepare_experts(self) -> ExpertRun:
        """Before a pipelined step's first stage: the experts its R chunks share (the
        strategy's ``prepare_experts``, e.g. ``hybrid``'s gathers); what that sent joins the
        statistics."""
        run = self.exchange_strategy().prepare_experts(self.experts, pipelined=True)
        self.stats.comm = self.stats.comm + run.stats
        return run

    def send(self, routed: Routed) -> Outbound:
        """Phase 1 of ``run_experts``: the rows to send for a routed input (statistics added)."""
        x_TH = autocast_rows(routed.x.reshape(-1, self.config.hidden_size), self.autocast_dtype)
        self._check_dtypes_agree(x_TH)
        out = self.exchange_strategy().dispatch_send(x_TH, routed.plan)
        self._record(x_TH.shape[0], routed, out.stats)
        return out

    def expert_rows(
        self, rows: torch.Tensor, handle: ExchangeHandle, run: ExpertRun
    ) -> torch.Tensor:
        """Phase 2: received rows -> the experts of ``run`` (``prepare_experts``) -> the rows
        to send back."""
        strategy = self.exchange_strategy()
        x_MH, counts_e = strategy.dispatch_recv(rows, handle)
        return strategy.combine_send(run.fn(x_MH, counts_e), handle)

    def receive(
        self,
        rows: torch.Tensor,
        handle: ExchangeHandle,
        weights_TK: torch.Tensor,
        like: torch.Tensor,
    ) -> torch.Tensor:
        """Phase 3: rows received back -> the output (shape and dtype of ``like``, the input),
        weighted by ``weights_TK`` (the plan's top-k weights, or a detached copy of them)."""
        y_NH = self.exchange_strategy().combine_recv(rows, handle)
        plan = dataclasses.replace(handle.plan, topk_weights_TK=weights_TK)
        return plan.unpermute(y_NH).to(like.dtype).view(like.shape)

    def _routed(self, routed: Routed) -> torch.Tensor | None:
        """All T*K assignments per expert (before drops), for the bias update; None without
        a bias (nothing reads them)."""
        if self.router.score_bias is None:
            return None
        ids = routed.plan.topk_ids_TK.reshape(-1)
        return count_ids(ids, self.config.num_experts)

    def _check_dtypes_agree(self, x_TH: torch.Tensor) -> None:
        """Once (on the first forward): every rank runs the same activation and weight dtypes.

        Rows of another dtype would be all-to-all'ed as a different number of bytes (gloo
        aborts the process). Later dtype changes are not re-checked: that would be a collective
        that only the changed rank enters. One rank has no one to disagree with: nothing is
        kept (under torch.compile a kept value is a guard, and its first change a recompile).
        """
        if self.ep.size == 1:
            return
        dtypes = (x_TH.dtype, self.experts.w1.dtype)
        if self._agreed_dtypes is None:
            check_ranks_agree(
                {"input dtype": dtypes[0], "expert weight dtype": dtypes[1]},
                group=self.ep.group,
                timeout_s=self.ep.timeout_s,
                what="MoELayer forward",
            )
        self._agreed_dtypes = dtypes

    def recomputation(self) -> contextlib.AbstractContextManager:
        """Inside: forwards repeat one that already ran (activation checkpointing's recompute
        in the backward, ``MoEGPT``), so they add no aux terms and no statistics (loads, bias
        counts, communication): the forward they repeat added them once. Reusable (a second
        backward through the same graph recomputes again)."""
        return _Recomputing(self)

    @eager_under_compile  # host bookkeeping (see _record and _add_aux)
    def _account(self, tokens: int, routed: Routed, comm: CommStats) -> None:
        """One forward's bookkeeping, after its compute: its aux terms and its statistics.
        Eager under ``torch.compile``, one graph break at the end of the forward: traced, the
        pending aux list's length and the statistics' int counters are guarded on, a recompile
        a step."""
        self._add_aux(routed.aux)
        self._record(tokens, routed, comm)

    @eager_under_compile  # host bookkeeping: traced, its int counters recompiled each step
    def _record(self, tokens: int, routed: Routed, comm: CommStats) -> None:
        """Add one forward to ``stats`` (not a recomputed one, see ``recomputation``). Eager
        under ``torch.compile``: ``stats.tokens`` and ``forwards`` are ints that change every
        forward, which Dynamo guards on (a recompile a step until its limit, seen on an H200)."""
        if self._recomputing:
            return
        # The detached terms: no graph (a recomputation, which skips this, must save the same
        # tensors as the forward it repeats; checkpointing matches them by order).
        self.stats.add(tokens, routed.plan.counts_E, comm, routed.aux, self._routed(routed))

    def _add_aux(self, aux: AuxTerms) -> None:
        if self._recomputing:  # the forward this repeats added its terms (and their graph)
            return
        pending = self._pending_aux
        if not aux.requires_grad:  # evaluation: fold into one entry (same batch loss)
            aux = aux.detach()
            if pending and not pending[-1].requires_grad:
                pending[-1] = fold_aux(pending[-1], aux)
                return
        pending.append(aux)
        if len(pending) == _UNREAD_AUX_WARN:
            warnings.warn(
                f"MoELayer: {_UNREAD_AUX_WARN} forwards added aux losses that were never read; "
                "call moesaic.aux_loss(model) once per backward (it returns and clears them), "
                "or the router graphs of every step stay in memory",
                stacklevel=3,
            )

    # ---- EP-size-independent state ---------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole layer's state (all E experts), gathered over the EP group; same on all ranks.

        Keys: ``router.weight`` [E, H], ``experts.w1`` / ``experts.w3`` [E, H, F],
        ``experts.w2`` [E, F, H]; with them the replicated ``router.score_bias`` [E] and
        ``shared_experts.w1`` / ``w3`` [H, S*Fs], ``w2`` [S*Fs, H], ``gate`` [1, H] when the
        config has them. A collective: every rank of the group must call it.
        """
        sd = {k: v.detach().clone() for k, v in self._replicated_state().items()}
        # The gather is in slot order (rank-major); put experts back in global-id order.
        slot_E = self.placement.slot_tensor()
        for name in EXPERT_PARAMS:
            w = getattr(self.experts, name)
            if w is not None:
                by_slot = self.ep.all_gather_dim0(
                    w.detach(), f"full_state_dict gather of experts.{name}"
                )
                sd[f"experts.{name}"] = by_slot.index_select(0, slot_E.to(by_slot.device))
        return sd

    @torch.no_grad()
    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load a full (EP-size-independent) state, keeping this rank's expert shard."""
        expected = set(self.full_state_keys())
        if set(sd) != expected:
            missing, extra = expected - set(sd), set(sd) - expected
            raise ValueError(
                f"state dict keys must be {sorted(expected)}; missing {sorted(missing)}, "
                f"unexpected {sorted(extra)}"
            )
        for key, dst in self._replicated_state().items():
            self._copy_checked(key, dst, sd[key])
        local = torch.tensor(self.experts.expert_ids, dtype=torch.long)
        for name in EXPERT_PARAMS:
            w = getattr(self.experts, name)
            if w is None:
                continue
            full = sd[f"experts.{name}"]
            want = (self.config.num_experts, *w.shape[1:])
            if tuple(full.shape) != want:
                raise ValueError(
                    f"experts.{name} has shape {tuple(full.shape)}, must be {want} "
                    "(all experts, as full_state_dict() returns)"
                )
            w.copy_(full.index_select(0, local.to(full.device)))

    def _replicated_state(self) -> dict[str, torch.Tensor]:
        """The tensors every rank holds whole, by full-state key."""
        out: dict[str, torch.Tensor] = {"router.weight": self.router.weight}
        if self.router.score_bias is not None:
            out["router.score_bias"] = self.router.score_bias
        if self.shared_experts is not None:
            for name, p in self.shared_experts.named_parameters():
                out[f"shared_experts.{name}"] = p
        return out

    def full_state_keys(self) -> list[str]:
        keys = list(self._replicated_state())
        keys += [f"experts.{n}" for n in EXPERT_PARAMS if getattr(self.experts, n) is not None]
        return keys

    @staticmethod
    def _copy_checked(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{name} has shape {tuple(src.shape)}, must be {tuple(dst.shape)}")
        dst.copy_(src)


class _Recomputing(contextlib.AbstractContextManager):
    def __init__(self, layer: MoELayer) -> None:
        self.layer = layer

    def __enter__(self) -> None:
        self.layer._recomputing = True

    def __exit__(self, *exc: object) -> None:
        self.layer._recomputing = False


def autocast_rows(x_TH: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x_TH`` in the autocast dtype when autocast is on for its device, else in ``dtype``
    (the layer's ``autocast_dtype``), else as it is: the experts' grouped matmuls (no autocast
    op) then compute in it, as an ``nn.Linear`` would, and the all-to-alls move its bytes."""
    device = x_TH.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    return x_TH if dtype is None else x_TH.to(dtype)


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The aux + z losses of every MoELayer in ``model`` over every forward since the last
    call, which clears them: call it once per backward, after all its forwards.

    Rule for several forwards per backward: they count as one batch of all their tokens. The
    balance loss uses the load fractions of all of them and each forward's mean router
    probabilities weighted by its share of the tokens, the z-loss is the token-weighted mean
    (``router_losses.combine_aux``). One batch split into R microbatch chunks therefore gives the
    same aux loss and gradients as the whole batch (up to summation order), which is what
    FlowMoE's per-chunk scaling (App. H) asks for; a single forward gives its own loss. Sum over
    layers; a scalar zero when no forward ran.
    """
    losses = [m.take_aux_loss() for m in model.modules() if isinstance(m, MoELayer)]
    present = [loss for loss in losses if loss is not None]
    if not present:
        return torch.zeros(())
    return _sum(present)


def _sum(losses: list[torch.Tensor]) -> torch.Tensor:
    """The sum of 0-d losses; one of them as it is (no stack and sum: kernels a GPU step's
    host would issue for nothing)."""
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


def is_expert_param(param: torch.Tensor) -> bool:
    """True for parameters sharded over the EP group (keep them out of the EP all-reduce)."""
    return bool(getattr(param, "_moesaic_expert", False))
