"""``hybrid``: HybridEP (§IV) - move experts inside expert domains, tokens only between them.

Shape legend: T tokens on this rank, H hidden, e local experts, P ranks of the expert-parallel
group, S = prod(S_ED^l) ranks of an expert domain (all levels), Q = P / S domains.

The group is described by a :class:`~moesaic.placement.topology.Topology`: the levels of the
layer's cluster description (or one level of P ranks), cut into domains of its options'
``domain_sizes`` (:class:`~moesaic.strategies.hybrid_options.HybridOptions`, ``config.options``;
None: one domain of the whole group). Every forward:

1. **Gather** (migration): each rank all-gathers the experts of its domain (``S * e`` experts,
   SR-compressed when the options' ``compression_ratio > 1``) level by level, outermost first
   (one group per level with a domain size above 1: the slow links carry the smallest
   bundles, as the cost model prices it). The
   gathered copies are cached per weight version (gradient accumulation and evaluation gather
   once per optimizer step) and can be prefetched (:class:`~moesaic.strategies.prefetch.
   ExpertPrefetcher`, its training hooks). Own experts always enter the computation exactly.
2. **Exchange** (partition): a token for expert ``g`` goes to the one rank that holds ``g``
   after the gathers and has this rank's offsets at every level (the same rank when ``g`` is in
   this rank's domain): the members of this rank's *offset group* (one per domain). That is a
   ``dropless`` all-to-all-v over the offset group, routed by a placement in which offset-group
   member ``q`` holds every expert of its domain, in its gathered order (``routing_placement``).
3. **Backward**: the exchange's all-to-alls run in reverse; the gradients of the gathered copies
   are reduced to their owners (per level, innermost first: an all-to-all over the level's
   group, summed in source order). Gathers and reduces move every weight matrix in one
   message per level.

Departure from the paper's multilevel routing: tokens go straight to their destination (one
all-to-all over the offset group) instead of hopping level by level. The bytes on every link of
the outer levels are the same; the inner levels carry the traffic once instead of once per hop.
A compressed gather is a straight-through estimator: the owner receives the gradient of its
expert's decoded copy as if it were the exact one (exact at ``CR = 1``).

Every rank issues the same collectives in the same order (the gather's cache key, the weights'
versions, changes on every rank together at the optimizer step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import torch

from moesaic.comm.collectives import CollectiveError, EPGroup, shortcuts_allowed
from moesaic.experts import GroupedExperts, expert_ffn
from moesaic.placement import ExpertPlacement
from moesaic.placement.topology import Topology
from moesaic.routing import RoutingPlan, build_plan
from moesaic.strategies.base import (
    CommStats,
    DispatchCombineStrategy,
    ExpertRun,
    Outbound,
    StrategyContext,
    Supports,
)
from moesaic.strategies.dropless import DroplessHandle, DroplessStrategy
from moesaic.strategies.hybrid_options import HybridOptions
from moesaic.strategies.migration import Gathered, PendingGather, Weights, start_gather
from moesaic.strategies.prefetch import ExpertPrefetcher

if TYPE_CHECKING:
    from collections.abc import Sequence

    from moesaic.config import MoEConfig
    from moesaic.strategies.base import ExpertFn, MoEStrategy, StrategyHooks
    from moesaic.trace import Recorder

__all__ = ["HybridStrategy", "hybrid_topology"]


def hybrid_topology(ctx: StrategyContext) -> Topology:
    """The expert domains of ``ctx``: cluster levels (or one level) cut by ``domain_sizes``."""
    P = ctx.group.size
    if ctx.topology is not None:
        levels = tuple(level.size for level in ctx.topology.levels)
        if ctx.topology.world_size != P:
            raise ValueError(
                f"the cluster description has {ctx.topology.world_size} ranks; the "
                f"expert-parallel group has {P} (hybrid needs one rank per cluster rank)"
            )
    else:
        levels = (P,)
    domain_sizes = ctx.config.options_as(HybridOptions).domain_sizes
    sizes = domain_sizes if domain_sizes is not None else levels
    if len(sizes) != len(levels):
        raise ValueError(
            f"domain_sizes ({list(sizes)}) must have one entry per cluster level ({len(levels)}: "
            f"sizes {list(levels)})"
        )
    return Topology(scaling_factors=levels, domain_sizes=tuple(sizes), world_size=P)


class _GatheredExperts(torch.autograd.Function):
    """Per weight matrix, local experts ``[e, *X]`` + gathered copies ``[S*e, *X]`` -> the
    domain's experts (``apply(levels, position, what, w_1, g_1, w_2, g_2, ...)``).

    Forward: each gathered bundle with this rank's slice replaced by its own (exact) weights.
    Backward: the adjoint of the level-by-level gathers, innermost level first: at each level
    the bundle's gradient is cut into the members' sub-bundles, each goes to its member (an
    all-to-all over the level's group) and the received ones are summed in source order. Every
    matrix of one dtype travels in one all-to-all per level (the gathers' one message).
    """

    @staticmethod
    def forward(ctx, levels: list[EPGroup], position: int, what: str, *pairs):
        ctx.levels, ctx.what = levels, what
        out = []
        for w_local, gathered in zip(pairs[::2], pairs[1::2]):
            e = w_local.shape[0]
            out.append(
                torch.cat(
                    [gathered[: position * e], w_local.detach(), gathered[(position + 1) * e :]]
                )
            )
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads_SeX):
        reduced: list[torch.Tensor | None] = [None] * len(grads_SeX)
        for dtype in dict.fromkeys(g.dtype for g in grads_SeX):
            index = [i for i, g in enumerate(grads_SeX) if g.dtype == dtype]
            rows = grads_SeX[index[0]].shape[0]
            flat = torch.cat([grads_SeX[i].reshape(rows, -1) for i in index], dim=1)
            for group in reversed(ctx.levels):
                received = torch.empty_like(flat)
                group.all_to_all_single(received, flat, what=f"{ctx.what} gradient reduce")
                parts = received.view(group.size, -1, flat.shape[1])
                flat = parts[0].clone()
                for s in range(1, group.size):
                    flat += parts[s]
            widths = [grads_SeX[i][0].numel() for i in index]
            for i, cols in zip(index, flat.split(widths, dim=1)):
                reduced[i] = cols.reshape(flat.shape[0], *grads_SeX[i].shape[1:])
        out: list[torch.Tensor | None] = [None, None, None]
        for g in reduced:
            out += [g, None]
        return tuple(out)


def bundle_order(topo: Topology, m: int) -> list[int]:
    """Owners of the experts rank ``m`` holds after the level-by-level gathers, in order.

    Level ``l``'s gather concatenates its members' bundles (members ascending); a member's
    bundle is ``m``'s with coordinate ``l`` replaced by the member's.
    """
    order = [m]
    for level in range(topo.num_levels):
        if topo.domain_sizes[level] == 1:
            continue
        new = []
        for n in sorted([m, *topo.ag_peers(m, level)]):
            x_n = topo.locate(n)[level]
            for r in order:
                loc = list(topo.locate(r))
                loc[level] = x_n
                new.append(topo.rank_of(loc))
        order = new
    return order


class HybridStrategy(DispatchCombineStrategy[DroplessHandle]):
    """HybridEP: expert all-gathers inside domains, dropless all-to-all between domains.

    A phase strategy: the gathers are ``prepare_experts`` (before a pipelined step's first
    stage, or at the start of a vanilla forward), the phases are ``dropless``'s over the offset
    group (``exchange_group``), so the pipelined schedules run it like any other.
    """

    name = "hybrid"
    needs_expert_weights = True
    options_class = HybridOptions
    supports = Supports(
        unsharded_why=(
            "it all-gathers whole expert weights inside each domain and reduces their "
            "gradients itself, which would need FSDP2's shards gathered first and its "
            "reduce-scatter bypassed (two owners of the same gradient)"
        )
    )

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        self.topology = topo = hybrid_topology(ctx)
        me, P = self.group.rank, self.group.size
        self.options = ctx.config.options_as(HybridOptions)
        self.compression_ratio = float(self.options.compression_ratio)
        self.domain_ranks = topo.domain_ranks(me)
        self.offset_ranks = self._offset_group_ranks(topo, me)
        self.bundle = bundle_order(topo, me)
        self.position = self.bundle.index(me)
        # One group per level with a domain size above 1 (members: this rank's level-l domain,
        # differing only in coordinate l), the same sets in the prefetch lane, then the offset
        # group.
        self.level_ranks = [
            sorted([me, *topo.ag_peers(me, lv)])
            for lv in range(topo.num_levels)
            if topo.domain_sizes[lv] > 1
        ]
        if not self.level_ranks and self.group.active and not shortcuts_allowed():
            # a domain of this rank alone still gathers (over a group of one) with the
            # single-rank shortcuts off, so one GPU runs the gathers, reduces and prefetch
            self.level_ranks = [[me]]
        # From the world's registry: one group per distinct rank set and lane, shared by every
        # hybrid layer (NCCL spends hundreds of MB per communicator).
        self.levels = self.group.subgroups(self.level_ranks, "main")
        # the same sets in the prefetch lane, made by the first prefetch (``reserve_prefetch``):
        # a model trained without the prefetcher (or evaluated) holds no such communicators
        self._prefetch_levels: list[EPGroup] | None = None
        (a2a,) = self.group.subgroups([self.offset_ranks], "main")
        self._routing = ExpertPlacement(
            ctx.config.num_experts,
            tuple(
                tuple(g for r in bundle_order(topo, q) for g in ctx.placement.local_experts(r))
                for q in self.offset_ranks
            ),
        )
        self._exchange = DroplessStrategy(StrategyContext(ctx.config, a2a, self._routing))
        self._cache: tuple[tuple, Weights] | None = None
        self._shared: list[torch.Tensor | None] | None = None  # of compressed gathers
        self._gathers = 0
        self._pending: tuple[tuple, Future[Gathered]] | None = None
        # set by ExpertPrefetcher when the prefetch was enqueued on a device side stream
        self.prefetch_ready: Any = None
        assert sorted(self.bundle) == self.domain_ranks
        assert len(self.domain_ranks) * len(self.offset_ranks) == P

    @staticmethod
    def _offset_group_ranks(topo: Topology, m: int) -> list[int]:
        """Ranks with ``m``'s offset at every level: one per domain, ascending."""
        offsets = [topo.domain_of(m, level)[1] for level in range(topo.num_levels)]
        return [
            n
            for n in range(topo.size)
            if all(topo.domain_of(n, lv)[1] == offsets[lv] for lv in range(topo.num_levels))
        ]

    @property
    def routing_placement(self) -> ExpertPlacement:
        return self._routing

    # ---- the gathered experts -----------------------------------------------------------------

    @staticmethod
    def _local_weights(experts: ExpertFn) -> Weights:
        if not isinstance(experts, GroupedExperts):
            raise TypeError(
                f"hybrid gathers expert weights and needs the layer's GroupedExperts, got "
                f"{type(experts).__name__}"
            )
        return (experts.w1, experts.w3, experts.w2)

    @staticmethod
    def _key(weights: Weights) -> tuple:
        return tuple((w.data_ptr(), w._version) if w is not None else None for w in weights)

    def reserve_prefetch(self, experts: GroupedExperts) -> Future[Gathered] | None:
        """For :class:`ExpertPrefetcher`: a slot for the next gather, None when not needed."""
        weights = self._local_weights(experts)
        if not self.levels:
            return None
        if self._prefetch_levels is None:  # every rank reserves at the same point
            self._prefetch_levels = self.group.subgroups(self.level_ranks, "prefetch")
        key = self._key(weights)
        if (self._cache is not None and self._cache[0] == key) or self._pending is not None:
            return None
        fut: Future[Gathered] = Future()
        self._pending = (key, fut)
        return fut

    @property
    def prefetch_levels(self) -> list[EPGroup]:
        """The level groups in the prefetch lane (made by the first ``reserve_prefetch``)."""
        if self._prefetch_levels is None:
            raise RuntimeError("hybrid: prefetch_levels before the first reserve_prefetch")
        return self._prefetch_levels

    def start_prefetch(self, experts: GroupedExperts) -> PendingGather:
        """For :class:`ExpertPrefetcher`'s thread: encode and issue on the prefetch group."""
        weights = self._local_weights(experts)
        return self._start(weights, self.prefetch_levels)

    def _gathered(self, weights: Weights) -> tuple[Weights, CommStats]:
        """The domain's experts (detached, decoded) for the current weights, and what the
        gathers sent (nothing when cached)."""
        finish, stats = self._begin_gathered(weights)
        return finish(), stats

    def _begin_gathered(self, weights: Weights) -> tuple[Callable[[], Weights], CommStats]:
        """Start what ``_gathered`` returns: the gathers are issued (their first level) now,
        the returned call waits for them, runs the inner levels and decodes; a prefetch or the
        cache is resolved now."""
        key = self._key(weights)
        stats = CommStats()
        if self._pending is not None:  # a prefetch was reserved on every rank: consume it
            pkey, fut = self._pending
            self._pending = None
            ready, self.prefetch_ready = self.prefetch_ready, None
            if ready is not None:  # enqueued on a device side stream: this stream waits for it
                ready.wait()  # (a comm.streams event: the current stream waits)
            try:
                tensors, pending = fut.result(timeout=self.group.timeout_s)
            except FutureTimeout as exc:
                raise CollectiveError(
                    f"hybrid: the prefetched expert gather did not arrive on rank "
                    f"{self.group.rank} (collective_timeout_s={self.group.timeout_s:g})"
                ) from exc
            stats = stats + self._gather_stats(pending)
            if pkey == key:
                self._cache = (key, tensors)
        if self._cache is not None and self._cache[0] == key:
            cached = self._cache[1]
            return (lambda: cached), stats
        pending = self._start(weights, self.levels)

        def finish() -> Weights:
            self._cache = (key, pending.result())
            return self._cache[1]

        return finish, stats + self._gather_stats(pending)

    def _start(self, weights: Weights, groups: list[EPGroup]) -> PendingGather:
        """One gather; the shared experts are recomputed every ``shared_expert_every``-th."""
        every = self.options.shared_expert_every
        shared = None if self._gathers % every == 0 else self._shared
        pending = start_gather(weights, groups, self.compression_ratio, shared=shared)
        self._shared, self._gathers = pending.shared, self._gathers + 1
        return pending

    def _gather_stats(self, pending: PendingGather) -> CommStats:
        peers = [0] * self.group.size
        for ranks, nbytes in zip(self.level_ranks, pending.level_bytes):
            for r in ranks:
                if r != self.group.rank:
                    peers[r] += nbytes
        return CommStats(
            expert_bytes=sum(peers), collectives=pending.collectives, peer_bytes_P=tuple(peers)
        )

    # ---- the phases -----------------------------------------------------------------------

    @property
    def exchange_group(self) -> EPGroup:
        """The offset group: one rank per domain, the token exchange's all-to-alls run on it."""
        return self._exchange.group

    def prepare_experts(self, experts: ExpertFn, *, pipelined: bool = False) -> ExpertRun:
        """The domain's experts (gathered, or from the cache or a prefetch) as one expert run.

        Vanilla: the copies stay in the graph, so each forward's backward reduces their
        gradients to the owners. Pipelined: the gathers are only issued here and waited for by
        the run's ``wait`` (the schedule calls it before the block's first expert stage, so the
        attention and gate stages before it overlap them); the R chunks' expert stages share
        detached leaves of the copies and ``finish_backward`` reduces their summed gradients
        once.
        """
        weights = self._local_weights(experts)
        kernels = self.ctx.config.kernels
        if not self.levels:
            return ExpertRun(
                _domain_ffn(weights, kernels), CommStats(peer_bytes_P=(0,) * self.group.size)
            )
        if not pipelined:
            gathered, stats = self._gathered(weights)
            return ExpertRun(_domain_ffn(self._in_graph(weights, gathered), kernels), stats)
        finish, stats = self._begin_gathered(weights)
        copies: list[tuple[torch.Tensor | None, ...]] = []  # [used, leaves] once waited for

        def wait() -> None:
            if not copies:
                used = self._in_graph(weights, finish())
                copies.extend([used, tuple(None if u is None else u.detach() for u in used)])
                for leaf in copies[1]:
                    if leaf is not None:
                        leaf.requires_grad_()

        def run(x_MH: torch.Tensor, counts_e: Sequence[int]) -> torch.Tensor:
            wait()
            return _domain_ffn(copies[1], kernels)(x_MH, counts_e)

        def finish_backward() -> None:
            # Every rank reduces every weight (zeros where its chunks left no gradient), so the
            # level groups see the same all-to-alls on every rank.
            wait()
            pairs = [
                (u, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
                for u, leaf in zip(*copies)
                if u is not None and leaf is not None and u.requires_grad
            ]
            if pairs:
                torch.autograd.backward([u for u, _ in pairs], [g for _, g in pairs])

        return ExpertRun(run, stats, finish_backward, wait)

    def _in_graph(self, weights: Weights, gathered: Weights) -> tuple[torch.Tensor | None, ...]:
        """The domain's experts: the gathered copies with this rank's own (exact) weights in
        place, in the autograd graph of the local weights (``_GatheredExperts``)."""
        present = [(w, g) for w, g in zip(weights, gathered) if w is not None and g is not None]
        pairs = [t for pair in present for t in pair]
        used = iter(_GatheredExperts.apply(self.levels, self.position, "hybrid experts", *pairs))
        return tuple(
            None if w is None or g is None else next(used) for w, g in zip(weights, gathered)
        )

    def dispatch_send(self, x_TH: torch.Tensor, plan: RoutingPlan) -> Outbound[DroplessHandle]:
        if plan.placement != self._routing:  # a plan routed by the owners: re-route it
            plan = build_plan(plan.topk_ids_TK, plan.topk_weights_TK, self._routing, plan.capacity)
        out = self._exchange.dispatch_send(x_TH, plan)
        return Outbound(out.rows, out.handle, self._to_group(out.stats))

    def dispatch_recv(
        self, rows: torch.Tensor, handle: DroplessHandle
    ) -> tuple[torch.Tensor, list[int]]:
        return self._exchange.dispatch_recv(rows, handle)

    def combine_send(self, y_MH: torch.Tensor, handle: DroplessHandle) -> torch.Tensor:
        return self._exchange.combine_send(y_MH, handle)

    def combine_recv(self, rows: torch.Tensor, handle: DroplessHandle) -> torch.Tensor:
        return self._exchange.combine_recv(rows, handle)

    def _to_group(self, stats: CommStats) -> CommStats:
        """Statistics over the offset group -> over the expert-parallel group."""
        peers = [0] * self.group.size
        for q, b in enumerate(stats.peer_bytes_P or (0,) * len(self.offset_ranks)):
            peers[self.offset_ranks[q]] += b
        return dataclasses.replace(stats, peer_bytes_P=tuple(peers))

    # ---- lifecycle hooks --------------------------------------------------------------------

    @classmethod
    def check_levels(cls, config: MoEConfig, level_sizes: tuple[int, ...]) -> None:
        """``options.domain_sizes`` must have one size per level, each dividing the level's
        size."""
        sizes = config.options_as(HybridOptions).domain_sizes
        if sizes is not None:
            try:
                Topology(scaling_factors=tuple(level_sizes), domain_sizes=sizes)
            except ValueError as exc:
                raise ValueError(f"options.{exc}") from None

    @classmethod
    def training_hooks(
        cls,
        layers: Sequence[tuple[MoEStrategy, ExpertFn]],
        *,
        recorder: Recorder | None = None,
    ) -> StrategyHooks:
        """The asynchronous communicator (:class:`~moesaic.strategies.prefetch.
        ExpertPrefetcher`): the next forwards' gathers start after every optimizer step."""
        return ExpertPrefetcher(layers, recorder=recorder)

    @classmethod
    def inference_config(cls, config: MoEConfig) -> MoEConfig:
        """``dropless`` without domains: one process holds every expert, so the domains (sized
        for the training cluster's levels) gather nothing and ``hybrid`` at EP 1 computes what
        ``dropless`` computes."""
        return dataclasses.replace(config, dispatcher="dropless", options=None)


def _domain_ffn(weights: tuple[torch.Tensor | None, ...], kernels: str = "torch") -> ExpertFn:
    """The expert FFN over the rows of the domain's experts, with ``weights`` (w1, w3, w2) on
    the ``kernels`` implementation (``MoEConfig.kernels``)."""
    w1, w3, w2 = weights
    assert w1 is not None and w2 is not None  # internal: w3 alone is optional

    def run(x_MH: torch.Tensor, counts_e: Sequence[int]) -> torch.Tensor:
        return expert_ffn(x_MH, counts_e, w1, w3, w2, kernels=kernels)

    return run
