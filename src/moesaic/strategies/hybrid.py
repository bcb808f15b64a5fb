"""``hybrid``: HybridEP (§IV) - move experts inside expert domains, tokens only between them.

Shape legend: T tokens on this rank, H hidden, e local experts, P ranks of the expert-parallel
group, S = prod(S_ED^l) ranks of an expert domain (all levels), Q = P / S domains.

The group is described by a :class:`~moesaic.placement.topology.Topology`: the levels of the
layer's cluster description (or one level of P ranks), cut into domains of its options'
``domain_sizes`` (:class:`~moesaic.strategies.hybrid_options.HybridOptions`, ``config.options``;
None: ``placement.topology.default_domain_sizes``, the innermost level whole: one node's ranks
when the description has nodes, else the whole group). Every forward:

1. **Gather** (migration): each rank all-gathers the experts of its domain (``S * e`` experts,
   in the experts' compute dtype (bf16 under ``--dtype bf16`` where the device multiplies it
   natively), SR-compressed when the options' ``compression_ratio > 1``) level by level,
   outermost first
   (one group per level with a domain size above 1: the slow links carry the smallest
   bundles, as the cost model prices it). The
   gathered copies are cached per optimizer step and weight version (gradient accumulation
   and evaluation gather once per optimizer step), this rank's slice overwritten by its own
   weights (the forward computes on the copies as they are), and can be prefetched (:class:`~moesaic.strategies.prefetch.
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
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import torch

from moesaic.comm.collectives import CollectiveError, EPGroup, shortcuts_allowed
from moesaic.experts import GroupedExperts, expert_compute_dtype, expert_ffn
from moesaic.kernels import KernelChoice
from moesaic.placement import ExpertPlacement
from moesaic.placement.topology import Topology, default_domain_sizes
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
    sizes = domain_sizes if domain_sizes is not None else default_domain_sizes(levels)
    if len(sizes) != len(levels):
        raise ValueError(
            f"domain_sizes ({list(sizes)}) must have one entry per cluster level ({len(levels)}: "
            f"sizes {list(levels)})"
        )
    return Topology(scaling_factors=levels, domain_sizes=tuple(sizes), world_size=P)


class _GatheredExperts(torch.autograd.Function):
    """Per weight matrix, local experts ``[e, *X]`` + the domain's gathered experts
    ``[S*e, *X]`` (this rank's slice already its own weights, ``HybridStrategy._store``) -> the
    domain's experts in the autograd graph of the local weights (``apply(levels, what, w_1,
    g_1, w_2, g_2, ...)``).

    Forward: each gathered bundle itself (a view: no copy). Backward: the adjoint of the
    level-by-level gathers, innermost level first: at each level the bundle's gradient is cut
    into the members' sub-bundles, each goes to its member (an all-to-all over the level's
    group) and the received ones are summed in source order, in fp32 when the bundle travels
    in a half type. Every matrix of one gathered dtype travels in one all-to-all per level,
    staged once (each member's part weight-major, so the sum's matrices are contiguous
    slices of it: no copy per matrix).
    """

    @staticmethod
    def forward(ctx, levels: list[EPGroup], what: str, *pairs):
        ctx.levels, ctx.what = levels, what
        ctx.local_dtypes = [w.dtype for w in pairs[::2]]
        ctx.wire_dtypes = [g.dtype for g in pairs[1::2]]
        return tuple(g.view_as(g) for g in pairs[1::2])

    @staticmethod
    def backward(ctx, *grads_SeX):
        reduced: list[torch.Tensor | None] = [None] * len(grads_SeX)
        for wire in dict.fromkeys(ctx.wire_dtypes):
            index = [i for i, d in enumerate(ctx.wire_dtypes) if d == wire]
            summed = _reduce_bundle(ctx.levels, [grads_SeX[i] for i in index], wire, ctx.what)
            for i, g in zip(index, summed):
                reduced[i] = g.to(ctx.local_dtypes[i])
        out: list[torch.Tensor | None] = [None, None]
        for r in reduced:
            out += [r, None]
        return tuple(out)


def _reduce_bundle(
    levels: Sequence[EPGroup], grads: Sequence[torch.Tensor], wire: torch.dtype, what: str
) -> list[torch.Tensor]:
    """The gradients ``[S*e, *X]`` of one dtype's gathered matrices, reduced to this rank's
    ``[e, *X]`` (``_GatheredExperts.backward``): per level one staging buffer (in ``wire``),
    the all-to-all's receive buffer, and the sum (fp32 for a half ``wire``), of which the
    results are views."""
    acc_dtype = torch.float32 if wire in (torch.bfloat16, torch.float16) else wire
    rows = grads[0].shape[0]
    parts: list[torch.Tensor] = [g.reshape(rows, -1) for g in grads]  # [rows, N_i] each
    for group in reversed(levels):
        size = group.size
        per = rows // size
        widths = [per * p.shape[1] for p in parts]
        staged = torch.empty(size, sum(widths), dtype=wire, device=parts[0].device)
        offset = 0
        for p, width in zip(parts, widths):  # member m's block: its rows of each matrix
            staged[:, offset : offset + width].copy_(p.reshape(size, width))
            offset += width
        del parts
        received = torch.empty_like(staged)
        group.all_to_all_single(received, staged, what=f"{what} gradient reduce")
        del staged
        acc = received[0].to(acc_dtype, copy=True)
        for m in range(1, size):
            acc += received[m]
        del received
        rows = per
        parts = [cols.view(rows, -1) for cols in acc.split(widths)]
    return [p.view(rows, *g.shape[1:]) for p, g in zip(parts, grads)]


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
        self._prefetch_shared_scope: list[EPGroup] = []
        (a2a,) = self.group.subgroups([self.offset_ranks], "main")
        self._routing = ExpertPlacement(
            ctx.config.num_experts,
            tuple(
                tuple(g for r in bundle_order(topo, q) for g in ctx.placement.local_experts(r))
                for q in self.offset_ranks
            ),
        )
        self._exchange = DroplessStrategy(StrategyContext(ctx.config, a2a, self._routing))
        # the groups a computed shared expert averages over, per lane (options.shared_expert)
        self._shared_scope = self._shared_groups(self.levels, "main")
        self._cache: tuple[tuple, Weights] | None = None
        self._shared: list[torch.Tensor | None] | None = None  # of compressed gathers
        self._gathers = 0
        self._pending: tuple[tuple, Future[Gathered]] | None = None
        # optimizer steps seen (``weights_updated``): part of the gathered copies' key, since
        # not every optimizer bumps the weights' version counters (fused AdamW never does,
        # foreach AdamW not under a dispatch mode)
        self._updates = 0
        # the dtype the domain's experts last computed in (``_gather_dtype``)
        self._compute_dtype: torch.dtype | None = None
        self._prefetch_dtype: torch.dtype | None = None
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

    def _key(self, weights: Weights, dtype: torch.dtype) -> tuple:
        """What the gathered copies are valid for: the optimizer steps seen, the gathered dtype
        and the weights (storage and version: a change outside an optimizer step)."""
        tensors = tuple((w.data_ptr(), w._version) if w is not None else None for w in weights)
        return (self._updates, dtype, tensors)

    def _gather_dtype(self, weights: Weights) -> torch.dtype:
        """The dtype the gathers move and the copies compute in: the experts' compute dtype
        (``expert_compute_dtype`` of the rows, bf16 under ``--dtype bf16`` where the device
        multiplies it natively, the weights' own otherwise). Inside an autocast region it
        follows from the autocast dtype; elsewhere (a pipelined stage, the prefetcher after
        the optimizer step) it is the dtype of the last forward's rows, or the weights' own
        before the first."""
        w = next(t for t in weights if t is not None)
        if torch.is_autocast_enabled(w.device.type):
            return expert_compute_dtype(w.device, torch.get_autocast_dtype(w.device.type))
        return self._compute_dtype if self._compute_dtype is not None else w.dtype

    def weights_updated(self) -> None:
        """After an optimizer step (the prefetcher's hook, before it reserves): the gathered
        copies of the old weights are stale whatever the version counters say; they are let
        go now, not when the next forward gathers again."""
        self._updates += 1
        self._cache = None

    def reserve_prefetch(self, experts: GroupedExperts) -> Future[Gathered] | None:
        """For :class:`ExpertPrefetcher`: a slot for the next gather, None when not needed."""
        weights = self._local_weights(experts)
        if not self.levels:
            return None
        if self._prefetch_levels is None:  # every rank reserves at the same point
            self._prefetch_levels = self.group.subgroups(self.level_ranks, "prefetch")
            self._prefetch_shared_scope = self._shared_groups(self._prefetch_levels, "prefetch")
        self._prefetch_dtype = dtype = self._gather_dtype(weights)
        key = self._key(weights, dtype)
        if (self._cache is not None and self._cache[0] == key) or self._pending is not None:
            return None
        fut: Future[Gathered] = Future()
        self._pending = (key, fut)
        return fut

    def prefetch_levels(self) -> list[EPGroup]:
        """The level groups in the prefetch lane (made by the first ``reserve_prefetch``)."""
        if self._prefetch_levels is None:
            raise RuntimeError("hybrid: prefetch_levels before the first reserve_prefetch")
        return self._prefetch_levels

    def start_prefetch(self, experts: GroupedExperts) -> PendingGather:
        """For :class:`ExpertPrefetcher`'s thread: encode and issue on the prefetch group."""
        weights = self._local_weights(experts)
        assert self._prefetch_dtype is not None  # internal: reserve_prefetch came first
        return self._start(
            weights, self.prefetch_levels(), self._prefetch_dtype, self._prefetch_shared_scope
        )

    def _gathered(self, weights: Weights) -> tuple[Weights, CommStats]:
        """The domain's experts (detached, decoded) for the current weights, and what the
        gathers sent (nothing when cached)."""
        finish, stats = self._begin_gathered(weights)
        return finish(), stats

    def _begin_gathered(self, weights: Weights) -> tuple[Callable[[], Weights], CommStats]:
        """Start what ``_gathered`` returns: the gathers are issued (their first level) now,
        the returned call waits for them, runs the inner levels and decodes; a prefetch or the
        cache is resolved now."""
        dtype = self._gather_dtype(weights)
        key = self._key(weights, dtype)
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
                self._store(key, weights, tensors)
        if self._cache is not None and self._cache[0] == key:
            cached = self._cache[1]
            return (lambda: cached), stats
        self._cache = None  # stale: let it go before the new copies arrive
        pending = self._start(weights, self.levels, dtype, self._shared_scope)

        def finish() -> Weights:
            return self._store(key, weights, pending.result())

        return finish, stats + self._gather_stats(pending)

    def _store(self, key: tuple, weights: Weights, gathered: Weights) -> Weights:
        """Cache the gathered copies with this rank's slice replaced by its own weights (in
        the copies' dtype: exact, where a compressed gather decoded an approximation), so the
        forward computes on them as they are (``_GatheredExperts``: no copy)."""
        with torch.no_grad():
            for w, g in zip(weights, gathered):
                if w is not None and g is not None:
                    e = w.shape[0]
                    g[self.position * e : (self.position + 1) * e].copy_(w.detach())
        self._cache = (key, gathered)
        return gathered

    def _shared_groups(self, levels: list[EPGroup], lane: str) -> list[EPGroup]:
        """The groups a computed shared expert is all-reduced over (``options.shared_expert``):
        the domain's level groups, and ``lane``'s offset group after them for "all" (the domain
        sums then summed over one rank per domain: every rank's experts once); none for "none".
        The offset group is asked of the registry only for "all", so no other scope makes a
        communicator in a lane that would not otherwise use it."""
        scope = self.options.shared_expert
        if scope == "none":
            return []
        if scope == "all" and len(self.offset_ranks) > 1:
            (offset,) = self.group.subgroups([self.offset_ranks], lane)
            return [*levels, offset]
        return levels

    def _start(
        self,
        weights: Weights,
        groups: list[EPGroup],
        dtype: torch.dtype,
        shared_groups: list[EPGroup],
    ) -> PendingGather:
        """One gather in ``dtype``; the shared experts are recomputed every
        ``shared_expert_every``-th (zeros, never all-reduced, for ``shared_expert = "none"``)."""
        every = self.options.shared_expert_every
        shared = None if self._gathers % every == 0 else self._shared
        if self.options.shared_expert == "none":
            shared = [None if w is None else w.new_zeros(w.shape[1:], dtype=dtype) for w in weights]
        pending = start_gather(
            weights,
            groups,
            self.compression_ratio,
            shared=shared,
            dtype=dtype,
            shared_groups=shared_groups,
        )
        self._shared, self._gathers = pending.shared, self._gathers + 1
        return pending

    def _gather_stats(self, pending: PendingGather) -> CommStats:
        peers = [0] * self.group.size
        for ranks, nbytes in zip(self.level_ranks, pending.level_bytes):
            for r in ranks:
                if r != self.group.rank:
                    peers[r] += nbytes
        if pending.shared_bytes and len(self._shared_scope) > len(self.levels):
            for r in self.offset_ranks:  # "all": the offset group's all-reduce
                if r != self.group.rank:
                    peers[r] += pending.shared_bytes
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
        if not self.levels:
            return ExpertRun(
                self._ffn(weights, experts), CommStats(peer_bytes_P=(0,) * self.group.size)
            )
        if not pipelined:
            gathered, stats = self._gathered(weights)
            return ExpertRun(self._ffn(self._in_graph(weights, gathered), experts), stats)
        finish, stats = self._begin_gathered(weights)
        used: list[torch.Tensor | None] = []  # the copies in the graph, once waited for
        # the chunks' summed gradients per copy (fp32 for half copies, as autocast's casts of
        # fp32 weights would have summed them), taken from each chunk's own detached alias
        sums: list[torch.Tensor | None] = []

        def wait() -> None:
            if not used:
                used.extend(self._in_graph(weights, finish()))
                sums.extend([None] * len(used))

        def run(x_MH: torch.Tensor, counts_e: Sequence[int]) -> torch.Tensor:
            wait()
            aliases = []
            for i, u in enumerate(used):
                alias = None if u is None else u.detach().requires_grad_()
                if alias is not None:
                    alias.register_post_accumulate_grad_hook(functools.partial(_add_to, sums, i))
                aliases.append(alias)
            return self._ffn(tuple(aliases), experts)(x_MH, counts_e)

        def finish_backward() -> None:
            # Every rank reduces every weight (zeros where its chunks left no gradient), so the
            # level groups see the same all-to-alls on every rank. Then the copies are let go:
            # the chunks' graphs, which held them for their backward, are gone.
            wait()
            pairs = [
                (u, g if g is not None else torch.zeros_like(u))
                for u, g in zip(used, sums)
                if u is not None and u.requires_grad
            ]
            used.clear()
            sums.clear()
            if pairs:
                torch.autograd.backward([u for u, _ in pairs], [g for _, g in pairs])

        return ExpertRun(run, stats, finish_backward, wait)

    def _ffn(self, weights: tuple[torch.Tensor | None, ...], experts: ExpertFn) -> ExpertFn:
        """``_domain_ffn`` on the layer's experts' kernel choice, noting the rows' compute
        dtype (what the next gathers move, ``_gather_dtype``)."""
        assert isinstance(experts, GroupedExperts)  # internal: _local_weights checked it
        ffn = _domain_ffn(weights, experts.kernel_choice)

        def run(x_MH: torch.Tensor, counts_e: Sequence[int]) -> torch.Tensor:
            self._compute_dtype = expert_compute_dtype(x_MH.device, x_MH.dtype)
            return ffn(x_MH, counts_e)

        return run

    def _in_graph(self, weights: Weights, gathered: Weights) -> tuple[torch.Tensor | None, ...]:
        """The domain's experts: the gathered copies (this rank's slice its own weights,
        ``_store``) in the autograd graph of the local weights (``_GatheredExperts``)."""
        present = [(w, g) for w, g in zip(weights, gathered) if w is not None and g is not None]
        pairs = [t for pair in present for t in pair]
        used = iter(_GatheredExperts.apply(self.levels, "hybrid experts", *pairs))
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


def _add_to(sums: list[torch.Tensor | None], i: int, alias: torch.Tensor) -> None:
    """A chunk's gradient of copy ``i`` (on its alias) into ``sums[i]``, in fp32 for a half
    copy; the alias lets go of it."""
    g, alias.grad = alias.grad, None
    assert g is not None  # internal: a post-accumulate hook runs after the gradient arrived
    if sums[i] is None:
        sums[i] = g.float() if g.dtype in (torch.bfloat16, torch.float16) else g
    else:
        sums[i].add_(g)  # type: ignore[union-attr]


def _domain_ffn(weights: tuple[torch.Tensor | None, ...], kernels: KernelChoice) -> ExpertFn:
    """The expert FFN over the rows of the domain's experts, with ``weights`` (w1, w3, w2) on
    the implementation ``kernels`` chose for the rows' device."""
    w1, w3, w2 = weights
    assert w1 is not None and w2 is not None  # internal: w3 alone is optional

    def run(x_MH: torch.Tensor, counts_e: Sequence[int]) -> torch.Tensor:
        return expert_ffn(x_MH, counts_e, w1, w3, w2, kernels=kernels.for_device(x_MH.device))

    return run
