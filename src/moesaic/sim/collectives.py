"""Analytical collective models on a :class:`~moesaic.cluster.spec.ClusterSpec`, in closed form.

The same network model as :mod:`moesaic.cluster.cost` (every member of a level sends and receives
through one uplink of that level's bandwidth; the busiest uplink direction bounds a phase; each
phase pays a one-way latency), but evaluated per level from the pattern's symmetry instead of
from a ``P x P`` matrix, so 8,000 ranks cost O(levels) (O(P) for a skewed all-to-all-v) rather
than O(P^2). Tests check every closed form against ``cluster.cost`` on small clusters.

Like the analytical backends of ASTRA-sim (``analytical`` network: per-dimension
``latency + bytes / bandwidth`` for each step of a ring/direct/halving-doubling algorithm on a
multi-dimensional topology, collectives decomposed dimension by dimension) and SimAI's
``SimAI_analytical`` (busbw-based time per collective and per group type, NVLink vs NIC), a
collective here is ``steps x (latency + bytes per step over the slowest crossed uplink)``:

* all-to-all (uniform, "direct"): one phase; a level-``j`` member of ``g_j`` ranks sends
  ``g_j (P - g_j) b`` up its uplink;
* all-to-all-v from a destination share vector (every source sends ``D s_dst``): one phase;
  a member ``G`` sends ``g D (1 - S_G)`` up and receives ``(P - g) D S_G`` down;
* ring all-reduce (gloo's, ``2 (P - 1)`` steps of ``bytes / P``) and ring all-gather
  (``P - 1`` steps of ``bytes``): every level-``j`` member has one ring edge leaving it;
* hierarchical all-reduce: reduce-scatter rings inside the innermost level, then each outer
  level on the shard, then all-gathers back (NCCL-style 2D/tree-free hierarchy);
* point-to-point: ``bytes / path bandwidth + path latency``;
* level-local patterns (HybridEP's gathers and hops, :func:`level_exchange_s`): each rank talks to
  ``n`` peers that differ from it only in the coordinate of one level;
* every offset group's all-to-all-v at once (HybridEP's exchange under a pipelined schedule,
  :func:`all_to_all_shares_s` with ``domain_sizes``).

**Latency floor.** Every step pays ``max(link latency, floor_s)``: software and stack overhead
that no real collective goes below (gloo on this machine's loopback: 0.15-0.2 ms per message,
``benchmarks/results/cluster_check.json``). ``bandwidth_scale`` multiplies every link's rate
(a calibrated efficiency; 1.0 = the spec's figures).

**Measured call floors.** A collective of a few bytes costs more than its steps' latencies: on
this machine's emulated links a 256-byte gloo all-reduce took 0.9-1.3 ms on 2 ranks at 0.12 ms
(the closed form's two steps: 0.24 ms) and 3.6-4.6 ms per call on 4 ranks sharing 2 cores
(0.72 ms), an all-to-all 0.5 ms (0.12 ms): more messages per step than the closed form counts
(gloo's handshakes), the stack's cost on each, and a collective thread waiting for a core.
FlowMoE's gradient chunks pay it once each (a chunk measured 0.7-0.8 ms on 2 ranks, 3.7 ms on
4: ``sim_sp_chunks.json``).
``calibrate --cluster`` measures both (:func:`moesaic.measure.calibrate.collective_calls`):
``allreduce_call_s``, the time per call in a stream of tiny all-reduces issued back to back
(as the pool issues its chunks), floors the sum of an all-reduce's step latencies;
``a2a_call_s``, a tiny all-to-all's time per call issued back to back, each waited (the
desynchronisation waits' ``call(0)``, :mod:`moesaic.sim.syncwait`, which add what a call
issued after compute waits beyond it), floors an all-to-all's latency. 0: not measured, the
steps' latencies alone. ``allreduce_loaded_call_s``, one tiny all-reduce issued alone while
every rank computes, floors the all-reduces of :meth:`LinkModel.loaded` (FlowMoE's chunks
issued beside the backward): with 4 ranks sharing 2 cores it measured 30-60 ms against 3-5
ms idle, on 2 ranks of a core each about the idle time
(``benchmarks/results/allreduce_under_load.json``). ``allreduce_alone_call_s``, one tiny
all-reduce issued alone on the idle machine, floors a training step's control collective
(:mod:`moesaic.sim.steptail`): 1.5-2.6x the stream's call on short links, and 2-5x on long
ones, where each of the ring's exchanges waits for its receiver's ready message.

**Measured collective shares.** ``a2a_shares`` and ``allreduce_shares`` (``(bytes_per_rank,
share)`` points from ``calibrate --cluster``, :class:`moesaic.sim.profile.CollectiveShare`)
further divide the bandwidth term of the all-to-all(-v)s and of the all-reduces / all-gathers
(:meth:`LinkModel.share`: log-linear in the collective's bytes per rank, clamped to the measured
range; 1.0 with none). ``simulate`` first holds the loaded regime's points to what a link can do
(:func:`rate_bounded_shares`): a collective of more bytes takes at least as long as one of fewer
plus the extra bytes at the link's full rate, so where a smaller size was measured slower than
that allows (a stall in its few timed calls, not a rate: a loaded 0.35 MB all-reduce timed at
111 ms against 70 ms at 1.4 MB), the larger size's time bounds it. :func:`p2p_s` uses the
link rates alone (the taskflow strategy prices its puts, an all-to-all cut into tiles, at the
all-to-all's share: ``sim.taskflow``).
Level-local exchanges (:func:`level_exchange_s`) and an offset group's exchange inside one
level use that level's measured share (``level_shares``, :class:`moesaic.sim.profile.
LevelShare`): on a machine whose inner links are faster than it moves bytes, the world's share,
set by the slowest link, prices them several times too fast (a 2-rank exchange inside a node of
e--+++'s cluster, 4 Gbit/s: 5.1 ms idle against 1.7 ms at the world's share). Where no level
was measured, the all-to-all share, or the all-reduce one for gathers.

Torch-free, standard library only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from moesaic.checks import check_int, check_non_negative, check_one_of, check_positive
from moesaic.cluster.spec import ClusterSpec
from moesaic.sim.interp import log_linear

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "LinkModel",
    "all_gather_s",
    "all_reduce_s",
    "all_to_all_s",
    "all_to_all_shares_s",
    "all_to_all_v_s",
    "hierarchical_all_reduce_s",
    "level_exchange_s",
    "offset_group_sizes",
    "p2p_s",
    "rate_bounded_shares",
    "ring_all_reduce_s",
]


# How a simulated gradient all-reduce runs: gloo's ring, the hierarchical one, or the faster
# of the two at each message size, as NCCL's tuner chooses between its algorithms.
ALL_REDUCE_ALGORITHMS = ("ring", "hierarchical", "best")


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkModel:
    """A cluster and the corrections calibration applies to its links.

    Attributes:
        spec: The cluster (levels: size, Gbit/s, one-way ms).
        floor_s: Latency floor per collective step, seconds (>= 0).
        bandwidth_scale: Multiplier of every level's bandwidth (> 0; 1.0: as specified).
        a2a_shares: ``(bytes_per_rank, share)`` points: the all-to-alls' measured share of the
            link rates (empty: 1.0).
        allreduce_shares: The same for all-reduces and all-gathers.
        all_reduce: The algorithm of :func:`all_reduce_s` (``ALL_REDUCE_ALGORITHMS``).
        a2a_call_s: The measured least time of one all-to-all call (a few bytes per rank;
            0: not measured): an all-to-all's latency term is at least this.
        allreduce_call_s: The measured time per all-reduce call of a few bytes in a stream
            of calls (0: not measured): an all-reduce's latency terms sum to at least this.
        allreduce_loaded_call_s: The measured time of one such call issued alone while every
            rank computes (0: not measured): what ``loaded()`` floors the all-reduces with.
        allreduce_alone_call_s: The measured time of one such call issued alone on the idle
            machine (0: not measured): a training step's control collective costs at least
            this (:mod:`moesaic.sim.steptail`).
        level_shares: Per level (by index), ``(bytes_per_rank, share)`` points of the measured
            exchange inside that level (:class:`moesaic.sim.profile.LevelShare`); a level with
            none, or past the tuple's end, is priced with the world's shares.
    """

    spec: ClusterSpec
    floor_s: float = 0.0
    bandwidth_scale: float = 1.0
    a2a_shares: tuple[tuple[float, float], ...] = ()
    allreduce_shares: tuple[tuple[float, float], ...] = ()
    all_reduce: str = "ring"
    a2a_call_s: float = 0.0
    allreduce_call_s: float = 0.0
    allreduce_loaded_call_s: float = 0.0
    allreduce_alone_call_s: float = 0.0
    level_shares: tuple[tuple[tuple[float, float], ...], ...] = ()

    def __post_init__(self) -> None:
        check_one_of("all_reduce", self.all_reduce, ALL_REDUCE_ALGORITHMS)
        check_non_negative("a2a_call_s", self.a2a_call_s)
        check_non_negative("allreduce_call_s", self.allreduce_call_s)
        check_non_negative("allreduce_loaded_call_s", self.allreduce_loaded_call_s)
        check_non_negative("allreduce_alone_call_s", self.allreduce_alone_call_s)
        if not isinstance(self.spec, ClusterSpec):
            raise ValueError(f"spec must be a ClusterSpec, got {type(self.spec).__name__}")
        check_non_negative("floor_s", self.floor_s)
        check_positive("bandwidth_scale", self.bandwidth_scale)
        for name in ("a2a_shares", "allreduce_shares"):
            _check_share_points(name, getattr(self, name))
        if not isinstance(self.level_shares, tuple) or len(self.level_shares) > len(
            self.spec.levels
        ):
            raise ValueError(
                f"level_shares must be a tuple of at most {len(self.spec.levels)} levels' points"
            )
        for level, points in enumerate(self.level_shares):
            _check_share_points(f"level_shares[{level}]", points)

    def loaded(self) -> LinkModel:
        """These links with the all-reduce call floor of a call issued beside compute
        (``allreduce_loaded_call_s`` where it is measured and higher)."""
        if self.allreduce_loaded_call_s <= self.allreduce_call_s:
            return self
        return dataclasses.replace(self, allreduce_call_s=self.allreduce_loaded_call_s)

    def share(self, kind: str, bytes_per_rank: float) -> float:
        """The measured share of ``kind`` (``"all_to_all"`` or ``"all_reduce"``) at
        ``bytes_per_rank``: linear in log bytes between measured sizes, the nearest one outside
        them, 1.0 when none was measured."""
        if kind not in ("all_to_all", "all_reduce"):
            raise ValueError(f"kind ({kind!r}) must be 'all_to_all' or 'all_reduce'")
        points = self.a2a_shares if kind == "all_to_all" else self.allreduce_shares
        return log_linear(points, bytes_per_rank)

    def level_share(self, level: int, bytes_per_rank: float) -> float | None:
        """The measured share of an exchange inside ``level`` of ``bytes_per_rank`` per rank
        (log-linear between its sizes, as :meth:`share`), or None where it was not measured."""
        if level >= len(self.level_shares) or not self.level_shares[level]:
            return None
        return log_linear(self.level_shares[level], bytes_per_rank)

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    def bytes_per_s(self, level: int) -> float:
        """Rate of a level's uplink, bytes per second per direction."""
        return self.spec.levels[level].bandwidth_gbps * 1e9 / 8 * self.bandwidth_scale

    def latency_s(self, level: int) -> float:
        """One-way latency across ``level``, floored."""
        return max(self.spec.levels[level].latency_ms * 1e-3, self.floor_s)

    def worst_latency_s(self, domain_sizes: Sequence[int] | None = None) -> float:
        """The worst one-way path latency (outermost separating level), floored; 0 for P = 1.

        With ``domain_sizes``: between the members of one offset group (HybridEP's exchange
        group, one rank per domain: :func:`offset_group_sizes`); 0 when it is one rank.
        """
        for level, q in enumerate(offset_group_sizes(self.spec, domain_sizes)):
            if q > 1:
                return self.latency_s(level)
        return 0.0

    def a2a_latency_s(self, domain_sizes: Sequence[int] | None = None) -> float:
        """An all-to-all's latency term: :meth:`worst_latency_s`, at least ``a2a_call_s``
        (0 where no rank talks to another)."""
        worst = self.worst_latency_s(domain_sizes)
        return max(worst, self.a2a_call_s) if worst > 0 else 0.0

    def ranks_per_member(self, level: int) -> int:
        return self.spec.ranks_per_group(level)

    def members(self, level: int) -> int:
        return self.spec.num_groups(level)


def _check_share_points(name: str, points: object) -> None:
    """``points`` is a tuple of positive ``(bytes_per_rank, share)`` pairs sorted by size."""
    if not isinstance(points, tuple) or any(len(p) != 2 for p in points):
        raise ValueError(f"{name} must be a tuple of (bytes_per_rank, share) pairs")
    for nbytes, share in points:
        check_positive(f"{name} bytes_per_rank", nbytes)
        check_positive(f"{name} share", share)
    if list(points) != sorted(points):
        raise ValueError(f"{name} must be sorted by bytes_per_rank")


def rate_bounded_shares(
    points: Sequence[tuple[float, float]],
) -> tuple[tuple[float, float], ...]:
    """Measured ``(bytes_per_rank, share)`` points of one collective, each held to what the
    larger sizes' measurements allow: a collective of ``b_j`` bytes takes at least as long as one
    of ``b_i < b_j`` plus the extra bytes at the link's full rate (share 1), so ``T(b_i) <=
    T(b_j) - (bandwidth term of b_j - b_i at share 1)``.

    Every closed form here is ``k b / share + latency`` for one collective on one cluster (``k``
    the share-1 seconds per byte), so the bound reads ``b_i (1 / s_i - 1) <= b_j (1 / s_j -
    1)``: the time a collective takes beyond its share-1 bandwidth term does not shrink as it
    grows. A point that breaks it (its few timed calls held a stall or a per-call delay that a
    larger call did not pay: the loaded streams, timed while every rank computes, hold such
    stalls, e.g. a 0.35 MB all-reduce at 111 ms against 70 ms at 1.4 MB on 4 ranks) is raised
    to the share at which it meets the bound set by the larger sizes, to share 1 at most (a
    larger size timed above share 1 says the closed form's latency is off, not that this size
    moves faster than the link); others are kept. Without it that point's share, clamped below
    the smallest measured size, prices every smaller collective (FlowMoE's gradient chunks) as
    if the stall were a rate.

    ``simulate`` (:func:`moesaic.sim.simulate.link_model`) applies it to the loaded regime's
    points: a loaded stream's time per call only gains from its errors (a stall adds, nothing
    takes away), so the larger sizes bound it from above; the idle points are means of isolated
    calls whose errors go both ways, and a large size timed a little fast would erase the
    per-call costs the smaller sizes really pay."""
    pts = [(float(b), float(s)) for b, s in points]
    out = []
    for i, (b, s) in enumerate(pts):
        beyond = b * (1.0 / s - 1.0)
        bound = min((bj * (1.0 / sj - 1.0) for bj, sj in pts[i + 1 :]), default=beyond)
        bound = max(bound, 0.0)  # to share 1 at most
        if beyond > bound:
            s = 1.0 / (1.0 + bound / b)
        out.append((b, s))
    return tuple(out)


def _bytes(name: str, value: float) -> float:
    v = check_non_negative(name, value)
    if not math.isfinite(v):
        raise ValueError(f"{name} ({value!r}) must be finite")
    return v


def all_to_all_s(link: LinkModel, bytes_per_pair: float) -> float:
    """A uniform all-to-all moving ``bytes_per_pair`` between every ordered pair of ranks."""
    b = _bytes("bytes_per_pair", bytes_per_pair)
    P = link.world_size
    if P < 2:
        return 0.0
    worst = 0.0
    for j in range(link.spec.num_levels):
        g = link.ranks_per_member(j)
        if g < P:
            worst = max(worst, g * (P - g) * b / link.bytes_per_s(j))
    return worst / link.share("all_to_all", P * b) + link.a2a_latency_s()


def offset_group_sizes(spec: ClusterSpec, domain_sizes: Sequence[int] | None) -> tuple[int, ...]:
    """Per level, the members of one offset group: ``size_l / S_l`` (``size_l`` without domains).

    HybridEP cuts level ``l`` into domains of ``S_l`` consecutive members; an offset group holds
    the ranks with the same offset inside their domain at every level (one rank per domain), and
    numbers them in mixed radix of these sizes, outermost first, as :class:`ClusterSpec` numbers
    its ranks.

    Raises:
        ValueError: ``domain_sizes`` has not one divisor of its level's size per level.
    """
    sizes = tuple(lv.size for lv in spec.levels)
    if domain_sizes is None:
        return sizes
    ds = tuple(domain_sizes)
    if len(ds) != len(sizes) or any(
        not isinstance(s, int) or s < 1 or n % s for s, n in zip(ds, sizes)
    ):
        raise ValueError(
            f"domain_sizes ({list(ds)}) must give a divisor of each level's size {list(sizes)}"
        )
    return tuple(n // s for n, s in zip(sizes, ds))


def all_to_all_shares_s(
    link: LinkModel,
    bytes_per_rank: float,
    shares_P: Sequence[float],
    *,
    domain_sizes: Sequence[int] | None = None,
) -> float:
    """An all-to-all-v where every rank sends ``bytes_per_rank * shares_P[dst]`` to each rank
    (its own share stays local): routing with the same expert popularity on every rank.

    O(P) per level: a member ``G`` of ``g`` ranks sends ``g D (1 - S_G)`` up its uplink and
    receives ``(P - g) D S_G`` down, ``S_G`` the shares of its ranks.

    With ``domain_sizes`` (HybridEP's exchange): every offset group runs this all-to-all-v over
    its own ``Q`` members at once, ``shares_P`` giving one share per member (per domain, in the
    order of :func:`offset_group_sizes`). A level-``l`` member holds ``g = prod_{i>l} Q_i``
    members of each of the ``prod_{i>l} S_i`` offset groups that cross it, all with the same
    shares, so its uplink carries that many times one group's load. All ``S`` = 1 is the
    all-to-all-v over the world. An offset group whose members differ in one level only is
    the exchange inside that level: its uniform part is priced at that level's measured share
    where there is one (:meth:`LinkModel.level_share`).
    """
    D = _bytes("bytes_per_rank", bytes_per_rank)
    Q_l = offset_group_sizes(link.spec, domain_sizes)
    S_l = (1,) * len(Q_l) if domain_sizes is None else tuple(domain_sizes)
    Q = math.prod(Q_l)
    if len(shares_P) != Q:
        what = "world_size" if domain_sizes is None else "offset group's size"
        raise ValueError(f"shares_P must have the {what} ({Q}) entries, got {len(shares_P)}")
    total = math.fsum(shares_P)
    if any(s < 0 for s in shares_P) or not math.isclose(total, 1.0, rel_tol=1e-9):
        raise ValueError(f"shares_P must be >= 0 and sum to 1 (sum {total})")
    if Q < 2:
        return 0.0

    def busiest_link_s(shares: Sequence[float]) -> float:
        worst = 0.0
        for j in range(link.spec.num_levels):
            g = math.prod(Q_l[j + 1 :])
            if g == Q:
                continue
            busiest = 0.0
            for m in range(Q // g):
                s = math.fsum(shares[m * g : (m + 1) * g])
                busiest = max(busiest, g * D * (1 - s), (Q - g) * D * s)
            worst = max(worst, math.prod(S_l[j + 1 :]) * busiest / link.bytes_per_s(j))
        return worst

    # The measured share is what a uniform all-to-all of D loses against its links: every rank
    # sends to and receives from all at once, every link busy both ways. Under skew one link
    # carries more than the others and several senders keep it full while the rest idle: it
    # moves at its rate. So the exchange takes the longer of the two, its busiest link at the
    # link's rate and the uniform exchange as measured (a 4-rank step on a 0.3 Gbit/s link whose
    # hot rank received 59-95% of the rows took the busiest links' time, 1.2 s, where the
    # share applied to them gave 1.8 s; the uniform exchange, 0.8 s, was no faster).
    varying = [level for level, q in enumerate(Q_l) if q > 1]
    inside = domain_sizes is not None and len(varying) == 1
    share = link.level_share(varying[0], D) if inside else None
    if share is None:
        share = link.share("all_to_all", D)
    even = busiest_link_s([1.0 / Q] * Q) / share
    worst = max(busiest_link_s(shares_P), even)
    return worst + link.a2a_latency_s(domain_sizes)


def all_to_all_v_s(link: LinkModel, bytes_PP: Sequence[Sequence[float]]) -> float:
    """An all-to-all-v of any traffic matrix (``bytes_PP[src][dst]``): the one cost home,
    :func:`moesaic.cluster.cost.network_time`, on the scaled links, plus one floored latency.

    O(P^2): for the small worlds measured runs have; use :func:`all_to_all_shares_s` at scale.
    """
    from moesaic.cluster.cost import network_time

    P = link.world_size
    nt = network_time(link.spec, bytes_PP)
    if P < 2 or nt.busiest_level is None:
        return 0.0 if P < 2 else link.a2a_latency_s()
    sent = max(math.fsum(row) for row in bytes_PP)
    share = link.share("all_to_all", sent)
    return nt.bandwidth_s / (link.bandwidth_scale * share) + link.a2a_latency_s()


def _ring_step_s(link: LinkModel, chunk: float, share: float) -> float:
    """One ring step's bandwidth term over all P ranks: every member of a level with > 1 member
    in the world has one ring edge leaving it; ``share`` divides it."""
    worst = 0.0
    for j in range(link.spec.num_levels):
        if link.members(j) > 1:
            worst = max(worst, chunk / link.bytes_per_s(j))
    return worst / share


def ring_all_reduce_s(link: LinkModel, bytes_per_rank: float) -> float:
    """gloo's ring all-reduce of ``bytes_per_rank``: ``2 (P - 1)`` steps of ``bytes / P``, each
    paying a latency; those latencies sum to at least ``link.allreduce_call_s``."""
    b = _bytes("bytes_per_rank", bytes_per_rank)
    P = link.world_size
    if P < 2:
        return 0.0
    steps = 2 * (P - 1)
    bandwidth = steps * _ring_step_s(link, b / P, link.share("all_reduce", b))
    return bandwidth + max(steps * link.worst_latency_s(), link.allreduce_call_s)


def all_gather_s(link: LinkModel, bytes_per_rank: float) -> float:
    """Ring all-gather of ``bytes_per_rank`` from every rank: ``P - 1`` steps of that size.

    Priced with the all-reduce share of the all-reduce that moves as much (``P b / 2``)."""
    b = _bytes("bytes_per_rank", bytes_per_rank)
    P = link.world_size
    if P < 2:
        return 0.0
    step = _ring_step_s(link, b, link.share("all_reduce", P * b / 2)) + link.worst_latency_s()
    return (P - 1) * step


def level_exchange_s(
    link: LinkModel, level: int, peers: int, bytes_per_peer: float, *, gather: bool = False
) -> float:
    """Each rank sends ``bytes_per_peer`` to ``peers`` ranks that differ from it only in the
    coordinate of ``level`` (HybridEP's gathers inside a domain and its token hops): one phase.

    The traffic leaves every member of ``level`` and of each inner level; a level-``j`` member's
    uplink carries ``g_j x peers x bytes`` each way. Latency: ``level``'s own (floored). Priced
    at the level's measured exchange share at ``(peers + 1) x bytes`` per rank
    (:meth:`LinkModel.level_share`, gathers too: the same traffic); where none was measured, as
    an all-to-all of that many bytes per rank, or with ``gather`` as the all-gather it is (the
    all-reduce share at half that, as :func:`all_gather_s`).
    """
    check_int("level", level, 0, link.spec.num_levels - 1)
    n = check_int("peers", peers, 0, link.spec.levels[level].size - 1)
    b = _bytes("bytes_per_peer", bytes_per_peer)
    if n == 0 or b == 0:
        return 0.0
    worst = max(
        link.ranks_per_member(j) * n * b / link.bytes_per_s(j)
        for j in range(level, link.spec.num_levels)
    )
    volume = (n + 1) * b
    share = link.level_share(level, volume)
    if share is None:
        share = link.share("all_reduce", volume / 2) if gather else link.share("all_to_all", volume)
    return worst / share + link.latency_s(level)


def hierarchical_all_reduce_s(link: LinkModel, bytes_per_rank: float) -> float:
    """Hierarchical all-reduce: ring reduce-scatter inside each innermost member, then on the
    shard at each outer level, then all-gathers back (same volume as the reduce-scatters).

    At level ``j`` (``s_j`` members per parent) rings of ``s_j`` run in parallel, one per rank
    position, on ``bytes / prod_{i>j} s_i``: ``2 (s_j - 1)`` steps of that over ``s_j``. The
    steps' latencies sum to at least ``link.allreduce_call_s``.
    """
    b = _bytes("bytes_per_rank", bytes_per_rank)
    bandwidth = latency = 0.0
    shard = b
    share = link.share("all_reduce", b)
    for j in reversed(range(link.spec.num_levels)):
        s = link.spec.levels[j].size
        if s < 2:
            continue
        chunk = shard / s
        step = max(
            link.ranks_per_member(i) * chunk / link.bytes_per_s(i)
            for i in range(j, link.spec.num_levels)
        )
        bandwidth += 2 * (s - 1) * step / share
        latency += 2 * (s - 1) * link.latency_s(j)
        shard = chunk
    if link.world_size < 2:
        return 0.0
    return bandwidth + max(latency, link.allreduce_call_s)


def all_reduce_s(link: LinkModel, bytes_per_rank: float) -> float:
    """A gradient all-reduce of ``bytes_per_rank`` by ``link.all_reduce``: the ring, the
    hierarchical one, or (``"best"``) the faster of the two at this size. On a one-level cluster
    they are the same collective."""
    if link.all_reduce == "ring":
        return ring_all_reduce_s(link, bytes_per_rank)
    hier = hierarchical_all_reduce_s(link, bytes_per_rank)
    if link.all_reduce == "hierarchical":
        return hier
    return min(ring_all_reduce_s(link, bytes_per_rank), hier)


def p2p_s(link: LinkModel, src: int, dst: int, nbytes: float) -> float:
    """One message of ``nbytes`` from ``src`` to ``dst`` alone on the network."""
    b = _bytes("nbytes", nbytes)
    if src == dst:
        return 0.0
    path = link.spec.path(src, dst)
    rate = path.bandwidth_gbps * 1e9 / 8 * link.bandwidth_scale
    return b / rate + max(path.latency_ms * 1e-3, link.floor_s)
