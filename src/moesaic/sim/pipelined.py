"""Task graphs of the block-pipelined steps: ``vanilla``, ``moe-only`` (R) and ``flowmoe`` (R, Sp).

The strategy is the row exchange the stages price (:class:`Costs`, ``EXCHANGES``): ``dropless``,
``padded`` or ``hybrid`` (dropless over the offset group, with :class:`ExpertGathers`: every
block's gathers before the pipeline, its gradient reduce once after its last chunk's expert
backward).

The orders are those of ``schedule/pipeline.py`` (its module docstring and ``BlockPipeline``'s
``_forward``/``_heads``/``_backward``), with the same task names; a test runs the real pipeline
on a small model and checks that its recorded compute and all-to-all order equals this one.
(``BlockPipeline`` interleaves the order with autograd calls and tensors, so it cannot take its
order from data without a rewrite of that module; the order test keeps the two in step.)

* forward, FlowMoE: per block, ``AT{r}`` then its ``D{r}`` for every chunk, then ``E{r}`` (after
  ``D{r}``) and ``C{r}``; ``AT{r}`` of the next block waits ``C{r}`` of this one.
  moe-only: every ``AT`` of a block, then every ``D``; a block waits for all ``C`` before it.
* backward in reverse; FlowMoE issues ``C``'s gradient of block l - 1 right after ``AT{r}.{l}``'s
  backward; moe-only after the whole block.
* gradients (replicated parameters only; expert shards have no replicas at EP = world): vanilla
  and moe-only all-reduce everything after the backward on the network lane; FlowMoE cuts the
  flat buffer (laid out in the order the gradients complete: block L first) into Sp-byte chunks
  that the pool (``schedule/pool.py``) issues on a process group of their own, in order: after
  each all-to-all the schedule waits for (a gap, until it issues the next all-to-all) at most
  one chunk whose gradients are ready by then, and after the last such wait every chunk left,
  as one call once its gradients complete (the cutting and placing: :mod:`moesaic.sim.grad_chunks`).
* FSDP2 sharding (``Costs.shard``, :mod:`moesaic.sim.fsdp`): each block's all-gathers before
  each pass of its forward and backward (``FS{r}.{block}``) and its reduce-scatters after
  each backward pass (``FR{r}.{block}``), the root's once, on the ``FSDP`` lane in issue order;
  prefetched (vanilla) they run as the lane frees, else when the pass starts; no all-reduce of
  replicated gradients, the tail after the last reduce-scatter.
* the step's tail (:mod:`moesaic.sim.steptail`): the control collective (norm, health flags,
  statistics; vanilla's after the gradients, the pipelined schedules' beside them), then the
  optimizer.

The chunks therefore run beside the all-to-alls, not between them: they are placed from the
timeline of the step without them (:func:`run_pipelined`), on a lane of their own (``GRAD``),
each waiting for its gap's opening (the wait's all-to-all and the compute before it) and its
gradients. A chunk issued in a gap runs while the backward computes, so its latency terms are
floored by the measured loaded call (``LinkModel.loaded``: one small all-reduce alone while
every rank computes took 30-60 ms on 4 ranks sharing 2 cores against 3-5 ms idle,
``benchmarks/allreduce_under_load.py``); the tail's chunks pay the idle stream's call floor.
Not modelled: a chunk's bytes sharing the link with the all-to-alls in flight, and an in-flight
chunk slowing them (on a traced 4-rank run the backward's all-to-alls ended 55 ms later under
flowmoe than moe-only; benchmarks/sim_validation.md, "Gradient chunks beside the backward").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from moesaic.checks import check_one_of, check_positive, check_positive_int
from moesaic.cluster.spec import ClusterSpec
from moesaic.config import capacity_slots
from moesaic.sim.collectives import (
    LinkModel,
    all_reduce_s,
    all_to_all_s,
    all_to_all_shares_s,
    offset_group_sizes,
)
from moesaic.sim.contention import CpuModel, skewed_compute_factor
from moesaic.sim.fsdp import FSDP, FsdpTraffic, sharded_fraction
from moesaic.sim.grad_chunks import cut_chunks, one_tail_chunk, place_chunks, wait_points
from moesaic.sim.graph import SimGraph, SimTask
from moesaic.sim.model import ModelSpec, expert_shares
from moesaic.sim.opcal import OpPrices
from moesaic.sim.prior import largest_source_factor
from moesaic.sim.profile import Profile
from moesaic.sim.steptail import add_tail, control_bytes
from moesaic.taskflow.engine import Timeline

__all__ = [
    "EXCHANGES",
    "Costs",
    "ExpertGathers",
    "build_pipelined",
    "check_degree",
    "domain_shares",
    "padded_capacity",
    "rank_shares",
    "run_pipelined",
]

NET = "net"  # the engine lane of the rank's network: all-to-alls, gathers, one all-reduce
GRAD = "grad"  # FlowMoE's gradient chunks: their own process group, in issue order
EXCHANGES = ("dropless", "padded", "hybrid")  # the row exchanges the stage model prices
Wait = SimTask | tuple[SimTask, ...] | None  # what a task waits for (``SimGraph.add``)


def rank_shares(model: ModelSpec, world: int) -> list[float]:
    """Share of the routed rows each rank's experts receive (contiguous placement), normalised
    to the rows actually kept."""
    if model.experts % world:
        raise ValueError(
            f"model.experts ({model.experts}) must be a multiple of the ranks ({world})"
        )
    shares = expert_shares(model, world)  # each layer's busiest rank first
    e = model.experts // world
    per_rank = [math.fsum(shares[p * e : (p + 1) * e]) for p in range(world)]
    kept = math.fsum(per_rank)
    return [s / kept for s in per_rank]


def domain_shares(model: ModelSpec, spec: ClusterSpec, domain_sizes: Sequence[int]) -> list[float]:
    """Share of the kept rows each expert domain's experts receive, in offset-group order
    (:func:`~moesaic.sim.collectives.offset_group_sizes`): the rows HybridEP's exchange sends
    to each member of an offset group. Domains all 1: :func:`rank_shares`."""
    Q_l = offset_group_sizes(spec, domain_sizes)
    per_rank = rank_shares(model, spec.world_size)
    out = [0.0] * math.prod(Q_l)
    for rank, share in enumerate(per_rank):
        q = 0
        for c, s, n in zip(spec.coords(rank), domain_sizes, Q_l):
            q = q * n + c // s
        out[q] += share
    return out


def check_degree(model: ModelSpec, degree: int) -> int:
    """R is a positive int that divides ``model.batch`` (chunks of whole sequences)."""
    check_positive_int("degree", degree)
    if model.batch % degree:
        raise ValueError(f"degree ({degree}) must divide model.batch ({model.batch})")
    return degree


@dataclass(kw_only=True, slots=True, frozen=True)
class ExpertGathers:
    """HybridEP's expert migration in a pipelined step (``hybrid`` under moe-only or flowmoe),
    as ``BlockPipeline`` runs it (tasks named as it records them, ``G.{block}`` on the
    ``gather`` lane, forward and backward).

    Every block's gathers run once, on the network before the block pipeline
    (``prepare_experts``; ``prefetch``: beside the first block's attention instead of before
    it); each block's gradient reduce of the gathered copies runs once after its last chunk's
    expert backward (``finish_backward``) and the attention backward waits for it (the
    schedule calls it on its own thread). The runtime issues it while the block's dispatch
    gradients travel; here it follows them on the rank's one network, which moves the bytes of
    both either way.

    Attributes:
        gather_s: one block's gathers, every level (``HybridParts.gather``).
        reduce_s: one block's gradient reduce (``HybridParts.grad_reduce``).
        prefetch: the first block's attention does not wait for the gathers.
    """

    gather_s: float
    reduce_s: float
    prefetch: bool = False


class Costs:
    """Durations of the pipelined tasks of one chunk (seconds) for a model on a world.

    ``strategy`` prices the row exchange (``EXCHANGES``): ``dropless`` (an all-to-all-v of the
    kept rows over the world, after one count exchange), ``padded`` (``C`` rows from every rank
    to every expert, zeros included: a uniform all-to-all; the experts compute the whole
    buffer, as GShard and DeepSpeed do, except where the per-operation measurements were
    taken on a CPU and the activation allows it (:func:`skips_padding`): the kept rows only;
    without a capacity factor ``C`` is the largest load, found by one all-reduce) or
    ``hybrid`` (dropless over the offset group of ``domain_sizes``: one rank per domain, each
    computing its domain's experts; with ``gathers``, the migration around the pipeline).

    Compute: with the profile's per-operation measurements (``profile.ops``) each task is
    priced from them (:class:`~moesaic.sim.opcal.OpPrices`; ``notes`` says what was
    extrapolated to this model), else at ``flops_per_s`` (backward twice the forward).
    """

    e_s: float  # the busiest rank's expert compute, forward and backward (seconds)
    e_bwd_s: float

    def __init__(
        self,
        model: ModelSpec,
        link: LinkModel,
        profile: Profile,
        degree: int,
        *,
        strategy: str = "dropless",
        domain_sizes: Sequence[int] | None = None,
        gathers: ExpertGathers | None = None,
    ):
        check_degree(model, degree)
        check_one_of("strategy", strategy, EXCHANGES)
        if (strategy == "hybrid") != (domain_sizes is not None):
            raise ValueError("domain_sizes is given with strategy 'hybrid' and only with it")
        if gathers is not None and strategy != "hybrid":
            raise ValueError("gathers are hybrid's: strategy must be 'hybrid'")
        P = link.world_size
        self.model, self.link, self.profile = model, link, profile
        self.gathers = gathers
        self.fsdp: FsdpTraffic | None = None
        self.replica_reduce_s: float | None = None  # replicas of the unsharded model
        tokens = model.tokens // degree
        if strategy == "padded":
            ex = _padded(model, link, tokens)
            if profile.ops is not None and skips_padding(profile.ops.device, model.activation):
                # the experts compute the kept rows only: dropless's count, padded's wire bytes
                shares = rank_shares(model, link.world_size)
                ex = ex._replace(rows=_kept_rows(model, tokens, shares), rank_shares=shares)
        else:
            ex = _dropless(model, link, tokens, domain_sizes)
        self.a2a_bytes, self.a2a_s, self.counts_s = ex.nbytes, ex.seconds, ex.counts_s
        self.block_grad_bytes = model.replicated_params_per_block() * model.param_bytes
        self.outer_grad_bytes = model.outer_params() * model.param_bytes
        params = model.layers * model.replicated_params_per_block() + model.outer_params()
        params += model.layers * model.experts // P * model.mats * model.hidden * model.ffn_hidden
        self.notes: list[str] = []
        if profile.ops is None:
            self._price_flops(profile, tokens, ex.rows, params)
        else:
            self._price_ops(OpPrices(profile.ops, model), tokens, ex.rows, params)
        self._share_cores(ex.rank_shares)

    def shard(self, fsdp: FsdpTraffic) -> None:
        """The step under FSDP2 sharding (:mod:`moesaic.sim.fsdp`): its gathers and
        reduce-scatters on their lane, no all-reduce of replicated gradients, the optimizer
        stepping the rank's shards."""
        if self.fsdp is not None:
            raise ValueError("these costs are already sharded")
        P = self.link.world_size
        self.fsdp = fsdp
        self.optimizer_s *= sharded_fraction(self.model, P, fsdp.dense_ranks // P)

    def _share_cores(self, shares: Sequence[float] | None) -> None:
        """The busiest rank's expert compute under skewed routing where the machine's ranks
        share its cores: the lighter ranks finish and free theirs
        (:func:`~moesaic.sim.contention.skewed_compute_factor`, which the contention then
        stretches). Only where every rank of the world is on one modelled machine and the
        exchange says its rows follow the ranks' ``shares`` (None: every rank computes
        alike)."""
        cpu = CpuModel.of(self.profile)
        if shares is None or cpu is None or self.profile.ranks_per_machine != len(shares):
            return
        f = skewed_compute_factor(shares, cpu)
        self.e_s, self.e_bwd_s = self.e_s * f, self.e_bwd_s * f

    def _price_flops(self, profile: Profile, tokens: int, rows: float, params: float) -> None:
        """Every task at the profile's FLOP rate plus its overhead (on a GPU its memory-bound
        bytes at the copy bandwidth instead of the overhead: ``Profile.compute_s``); backward
        twice forward."""
        model = self.model
        self.at_s = profile.stage_s(model, tokens)
        self.head_s = 0.0 if model.layer_only else profile.compute_s(model.head_flops(tokens))
        # On a GPU: the grouped GEMMs at their measured efficiency for the rows per local
        # expert, and the layer's small kernels (a third forward, as backward is twice it).
        per_expert = rows / max(1, model.experts // self.link.world_size)
        gemm_s = profile.expert_gemm_s(model.expert_flops(rows), per_expert)
        self.e_s = gemm_s + profile.compute_s(0.0, model.expert_bytes(rows))
        self.e_s += profile.layer_launch_s() / 3
        # A block's forward (attention and experts) takes at least the host's third of the
        # layer's launches, when they take longer than its kernels (a host-bound step).
        self.e_s = max(self.e_s, profile.host_floor_s() / 3 - self.at_s)
        self.at_bwd_s, self.e_bwd_s, self.head_bwd_s = 2 * self.at_s, 2 * self.e_s, 2 * self.head_s
        # AdamW: ~10 FLOPs per parameter; a layer timed alone takes no optimizer step.
        self.optimizer_s = 0.0 if model.layer_only else profile.compute_s(10.0 * params)

    def _price_ops(self, prices: OpPrices, tokens: int, rows: float, params: float) -> None:
        """Every task from the model's measured operations (``moesaic.sim.opcal``)."""
        self.at_s = prices.stage_s(tokens)
        self.at_bwd_s = prices.stage_s(tokens, backward=True)
        self.e_s = prices.expert_s(rows)
        self.e_bwd_s = prices.expert_s(rows, backward=True)
        self.head_s = prices.head_s(tokens)
        self.head_bwd_s = prices.head_s(tokens, backward=True)
        layer_only = self.model.layer_only
        self.optimizer_s = (
            0.0 if layer_only else prices.optimizer_s(params * self.model.param_bytes)
        )
        self.notes = list(prices.notes)

    def replicate(self, reduce_s: float) -> None:
        """The step as one of several replicas of the unsharded model (EP on this link, the
        world outside it): its gradient reduction after the backward takes ``reduce_s``
        (:func:`moesaic.sim.fsdp.replica_reduce_s`: the dense gradients over the world, the
        experts' over the replicas) instead of the dense all-reduce on this link."""
        self.replica_reduce_s = reduce_s

    def grad_bytes(self) -> float:
        """The replicated gradients' bytes to all-reduce (none when FSDP2 reduce-scatters
        them)."""
        if self.fsdp is not None:
            return 0.0
        return self.model.layers * self.block_grad_bytes + self.outer_grad_bytes

    def all_reduce_s(self, nbytes: float, loaded: bool = False) -> float:
        """An all-reduce of ``nbytes``; ``loaded``: issued beside compute (the loaded call
        floor, ``LinkModel.loaded``)."""
        return all_reduce_s(self.link.loaded() if loaded else self.link, nbytes)


def skips_padding(device: str, activation: str) -> bool:
    """Whether ``padded``'s experts compute on the filled rows only (its ``skip_padding`` rule,
    ``strategies.padded``): on a CPU, where finding them costs no device sync, and for an
    activation that maps a zero row to a zero row and zero gradients (SwiGLU, not GELU)."""
    return device == "cpu" and activation == "swiglu"


class _Exchange(NamedTuple):
    """One chunk's row exchange: the busiest rank's expert rows, the bytes a rank sends, the
    all-to-all's seconds and those of what precedes it (the counts, or the capacity), and
    each rank's share of the computed rows when they follow the routing (dropless, hybrid
    with domains of one rank, padded on its kept rows), else None (every rank computes its
    whole buffer, or a domain's members compute the domain's experts alike)."""

    rows: float
    nbytes: float
    seconds: float
    counts_s: float
    rank_shares: Sequence[float] | None = None


def _dropless(
    model: ModelSpec, link: LinkModel, tokens: int, domain_sizes: Sequence[int] | None
) -> _Exchange:
    """The all-to-all-v of the kept rows (over the offset groups with ``domain_sizes``)."""
    kept = math.fsum(expert_shares(model))
    if domain_sizes is None:
        shares = rank_shares(model, link.world_size)
    else:
        shares = domain_shares(model, link.spec, domain_sizes)
    Q = len(shares)
    nbytes = tokens * model.top_k * kept * model.hidden * model.act_bytes
    rows = _kept_rows(model, tokens, shares)
    per_rank = shares if len(shares) == link.world_size else None  # domains of one rank each
    if Q == 1:
        return _Exchange(rows, nbytes, 0.0, 0.0, per_rank)
    seconds = all_to_all_shares_s(link, nbytes, shares, domain_sizes=domain_sizes)
    # dropless exchanges its counts first: one more collective of a few bytes.
    return _Exchange(rows, nbytes, seconds, link.a2a_latency_s(domain_sizes), per_rank)


def _kept_rows(model: ModelSpec, tokens: int, shares: Sequence[float]) -> float:
    """The kept rows the busiest of the ``len(shares)`` receivers computes (its share of the
    world's kept rows; ``shares`` sum to 1)."""
    kept = math.fsum(expert_shares(model))
    return tokens * model.top_k * kept * len(shares) * max(shares)


def padded_capacity(model: ModelSpec, tokens: int, world: int) -> int:
    """``C``, the rows every rank sends every expert in one chunk of ``tokens`` per rank: the
    capacity ``ceil(cf T K / E)``, else the largest load one rank sends one expert (the
    runtime all-reduces it, MAX). The loads a run records (and the prior) are the world's sums
    over a step, so with them the busiest expert's share of the step is raised by
    :func:`~moesaic.sim.prior.largest_source_factor` (each rank's chunk routes its own draw;
    the largest of the world's); with a stated skew (``routing_skew``) or uniform routing every
    rank sends alike. At most ``tokens`` (a token picks an expert once)."""
    E = model.experts
    if model.capacity_factor > 0:
        return capacity_slots(model.capacity_factor, tokens, model.top_k, E)
    rows = tokens * model.top_k * max(expert_shares(model, E))
    if model.measured_loads and world > 1:
        rows *= largest_source_factor(
            E, model.top_k, tokens, model.tokens * world, model.hidden, world
        )
    return min(tokens, math.ceil(rows - 1e-9))


def _padded(model: ModelSpec, link: LinkModel, tokens: int) -> _Exchange:
    """The padded all-to-all of :func:`padded_capacity` rows per (rank, expert); the experts
    compute the whole buffer."""
    P, E = link.world_size, model.experts
    capacity = padded_capacity(model, tokens, P)
    # without a capacity the largest load is agreed by one all-reduce (MAX) of a scalar
    agree_s = all_reduce_s(link, 8.0) if P > 1 and model.capacity_factor <= 0 else 0.0
    pair_bytes = E // P * capacity * model.hidden * model.act_bytes
    seconds = all_to_all_s(link, pair_bytes) if P > 1 else 0.0
    return _Exchange(P * (E // P) * capacity, P * pair_bytes, seconds, agree_s)


def build_pipelined(costs: Costs, *, degree: int, overlap: bool) -> tuple[SimGraph, list[SimTask]]:
    """The forward and backward of the block pipeline (no gradient reduction yet), with
    ``hybrid``'s gathers before it and gradient reduces in it when ``costs.gathers`` is set.

    Returns the graph and, per block (index 0 = block 1), the task after which its replicated
    gradients are complete (its last ``AT`` backward: chunk 1).
    """
    g = SimGraph()
    first = _gathers(g, costs)
    heads = _forward(g, costs, degree, overlap, first)
    return g, _backward(g, costs, degree, overlap, heads)


def _comp(name: str, s: float, phase: str, blk: int = 0, r: int = 0) -> SimTask:
    return SimTask(name, "compute", s, phase, blk, r)


def _a2a(costs: Costs, name: str, s: float, phase: str, blk: int, r: int) -> SimTask:
    return SimTask(name, "a2a", s, phase, blk, r, costs.a2a_bytes)


def _gathers(g: SimGraph, costs: Costs) -> SimTask | None:
    """Every block's gathers on the network before the pipeline; returns the task the first
    attention waits for (None: nothing, or prefetched gathers)."""
    ag = costs.gathers
    if ag is None or ag.gather_s == 0:
        return None
    for blk in range(1, costs.model.layers + 1):
        last = g.add(NET, SimTask(f"G.{blk}", "gather", ag.gather_s, "fwd", blk))
    return None if ag.prefetch else last


def _forward(
    g: SimGraph, c_: Costs, R: int, overlap: bool, first: SimTask | None
) -> dict[int, SimTask]:
    """Every block's forward and the heads; returns the heads by chunk."""
    chunks = range(1, R + 1)
    last_c: dict[int, SimTask] = {}
    dispatch_s = c_.a2a_s + c_.counts_s
    start: Wait = first
    fs = c_.fsdp
    if fs is not None and fs.root_gather_s > 0:
        root_task = SimTask("FS.root", "gather", fs.root_gather_s, "fwd", 0, 0, fs.root_bytes)
        root = g.add(FSDP, root_task)
        start = root if first is None else (first, root)
    for blk in range(1, c_.model.layers + 1):
        ats = {}
        for r in chunks:
            wait: Wait = start if r == 1 else None
            if blk > 1:
                wait = last_c[r] if overlap else last_c[R]
            wait = _fsdp_gather(g, c_, "fwd", blk, r, wait)
            ats[r] = g.add("compute", _comp(f"AT{r}.{blk}", c_.at_s, "fwd", blk, r), wait)
            if overlap:
                g.add(NET, _a2a(c_, f"D{r}.{blk}", dispatch_s, "fwd", blk, r), ats[r])
        if not overlap:
            for r in chunks:
                g.add(NET, _a2a(c_, f"D{r}.{blk}", dispatch_s, "fwd", blk, r), ats[R])
        for r in chunks:
            e = g.add("compute", _comp(f"E{r}.{blk}", c_.e_s, "fwd", blk, r), f"fwd:D{r}.{blk}")
            last_c[r] = g.add(NET, _a2a(c_, f"C{r}.{blk}", c_.a2a_s, "fwd", blk, r), e)
    heads = {}
    for r in chunks:
        wait = last_c[r] if overlap else last_c[R]
        heads[r] = g.add("compute", _comp(f"head{r}", c_.head_s, "fwd", 0, r), wait)
    return heads


def _backward(
    g: SimGraph, c_: Costs, R: int, overlap: bool, heads: dict[int, SimTask]
) -> list[SimTask]:
    """Every block's backward, in reverse; returns each block's last ``AT`` backward."""
    rev = list(reversed(range(1, R + 1)))
    L = c_.model.layers
    done: list[SimTask] = [heads[1]] * L
    prev: dict[int, SimTask] = {}
    for r in rev:
        prev[r] = g.add("compute", _comp(f"head{r}", c_.head_bwd_s, "bwd", 0, r))
    for blk in range(L, 0, -1):
        cb = {}
        for r in rev:
            wait = prev[r] if overlap else prev[1]
            cb[r] = g.add(NET, _a2a(c_, f"C{r}.{blk}", c_.a2a_s, "bwd", blk, r), wait)
        db: dict[int, SimTask] = {}
        for r in rev:
            e_wait = _fsdp_gather(g, c_, "bwd", blk, r, cb[r])
            e = g.add("compute", _comp(f"E{r}.{blk}", c_.e_bwd_s, "bwd", blk, r), e_wait)
            db[r] = g.add(NET, _a2a(c_, f"D{r}.{blk}", c_.a2a_s, "bwd", blk, r), e)
        if c_.gathers is not None and c_.gathers.reduce_s > 0:
            # after the last chunk's expert backward (e); on the network after the D's, so
            # waiting for it is waiting for every D of the block too
            rs = SimTask(f"G.{blk}", "gather", c_.gathers.reduce_s, "bwd", blk)
            db = dict.fromkeys(rev, g.add(NET, rs, e))
        for r in rev:
            wait = db[r] if overlap else db[1]
            prev[r] = g.add("compute", _comp(f"AT{r}.{blk}", c_.at_bwd_s, "bwd", blk, r), wait)
            sharded = c_.fsdp
            if sharded is not None and sharded.reduce_s > 0:  # the pass's gradients
                nbytes = sharded.reduce_bytes
                red = SimTask(f"FR{r}.{blk}", "gather", sharded.reduce_s, "bwd", blk, r, nbytes)
                g.add(FSDP, red, prev[r])
        done[blk - 1] = prev[1]
    fs = c_.fsdp
    if fs is not None and fs.root_reduce_s > 0:
        root = SimTask("FR.root", "gather", fs.root_reduce_s, "bwd", 0, 0, fs.root_reduce_bytes)
        g.add(FSDP, root, prev[1])
    return done


def _fsdp_gather(
    g: SimGraph,
    c_: Costs,
    phase: str,
    blk: int,
    r: int,
    wait: Wait,
) -> Wait:
    """FSDP2's all-gather of block ``blk``'s units before chunk ``r``'s pass (``phase``), on
    the ``FSDP`` lane; returns what the pass waits for (``wait`` and the gather). Prefetched:
    issued as the lane frees (the previous block's pass started); else when the pass would
    start (after ``wait``)."""
    fs = c_.fsdp
    if fs is None or fs.gather_s == 0:
        return wait
    name = f"FS{r}.{blk}"
    task = SimTask(name, "gather", fs.gather_s, phase, blk, r, fs.gather_bytes)
    ag = g.add(FSDP, task, None if fs.prefetch else wait)
    if wait is None:
        return ag
    several = isinstance(wait, tuple) and not isinstance(wait, SimTask)  # (a task is a tuple)
    return (*(wait if several else (wait,)), ag)


def run_pipelined(
    costs: Costs,
    *,
    degree: int,
    overlap: bool,
    chunk_bytes: float | None,
    in_gaps: bool = True,
    early: bool = True,
    durations: Callable[[SimTask], float] | None = None,
    tail_as_one: bool = True,
) -> tuple[SimGraph, Timeline]:
    """Builds and simulates a step.

    Args:
        costs: the tasks' durations.
        degree: R.
        overlap: FlowMoE's order (True) or moe-only's (False).
        chunk_bytes: None: one all-reduce after the backward (vanilla, moe-only); a number:
            Sp-byte all-reduce chunks.
        in_gaps: the chunks go where the pool puts them (True), or all after the last
            all-to-all (False: centralized, FlowMoE's ``T*_b``).
        early: the step's control collective travels with the last gradients (the pipelined
            schedules) rather than after them (vanilla; :mod:`moesaic.sim.steptail`).
        durations: overrides each compute and all-to-all task's seconds (tests: random times).
        tail_as_one: the chunks placed after the last gap go as one call (the pool's rule,
            ``schedule/grad_layout.py``); False: one call per Sp chunk, the paper's model (its
            Theorem 2: without a startup cost a smaller Sp is never slower).
    """
    g, done = build_pipelined(costs, degree=degree, overlap=overlap)
    if durations is not None:
        g.lanes = {
            k: [(t._replace(seconds=durations(t)), w) for t, w in v] for k, v in g.lanes.items()
        }
    last = g.lanes["compute"][-1][0]  # the backward's end
    backward_end = last if early else None  # the pipelined schedules' early collective waits it
    tail = control_bytes(costs.model.layers, costs.model.experts)
    if costs.fsdp is not None:
        if chunk_bytes is not None:
            raise ValueError(
                "FSDP2 sharding (dp_shard) runs with one gradient reduction per unit: a "
                "schedule that all-reduces gradient chunks in the backward cannot be priced "
                "with it"
            )
        # the last reduce-scatter (the root's, after the backward's last compute) on its lane
        fsdp_lane = g.lanes.get(FSDP, [])
        reduced, lane = (fsdp_lane[-1][0], FSDP) if fsdp_lane else (last, NET)
        add_tail(
            g,
            costs.link,
            lane,
            reduced,
            costs.optimizer_s,
            nbytes=tail,
            backward_end=backward_end,
            own_norm=True,
        )
        return g, g.run()
    if chunk_bytes is None:
        total = costs.grad_bytes()
        if total == 0:  # layer_only: no replicated gradient, no optimizer step
            return g, g.run()
        seconds = costs.replica_reduce_s
        if seconds is None:
            seconds = costs.all_reduce_s(total)
        ar = g.add(NET, SimTask("AR1", "allreduce", seconds, "bwd", 0, 0, total), last)
        add_tail(g, costs.link, NET, ar, costs.optimizer_s, nbytes=tail, backward_end=backward_end)
        return g, g.run()
    check_positive("chunk_bytes", chunk_bytes)
    chunks = cut_chunks(costs.block_grad_bytes, costs.outer_grad_bytes, done, chunk_bytes)
    tl = g.run()  # the step without chunks: they delay none of its tasks
    placed = place_chunks(chunks, wait_points(g, tl, NET), tl, in_gaps)
    if in_gaps and tail_as_one:
        chunks, placed = one_tail_chunk(chunks, placed)
    task = None
    lane_end = 0.0
    for k, ((nbytes, wait), (point, in_gap)) in enumerate(zip(chunks, placed), start=1):
        opening = point.keys() if point is not None else ()
        keys = tuple(dict.fromkeys((*opening, wait)))  # the gap's opening and the hook
        ready = max(tl.end[key] for key in keys)  # the chunks delay no task of ``tl``
        start = max(ready, lane_end)
        # A gap's chunk runs beside the backward's compute and waits the loaded call floor
        # (a rank's communication thread waking among busy ones). One issued while an earlier
        # chunk is in flight shares that wait: it ends the idle price after the earlier one,
        # or its own loaded wait after it was ready, whichever is later ("shared" waits,
        # adopted on rules 17-21, docs/simulator.md).
        lane_end = max(
            ready + costs.all_reduce_s(nbytes, loaded=in_gap),
            lane_end + costs.all_reduce_s(nbytes),
        )
        task = SimTask(f"AR{k}", "allreduce", lane_end - start, "bwd", 0, 0, nbytes)
        g.add(GRAD, task, keys if len(keys) > 1 else keys[0])
    assert task is not None  # internal: a positive total cuts into at least one chunk
    add_tail(g, costs.link, GRAD, task, costs.optimizer_s, nbytes=tail, backward_end=backward_end)
    return g, g.run()
