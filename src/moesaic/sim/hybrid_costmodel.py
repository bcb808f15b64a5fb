"""HybridEP's stream-based cost model (§III, Eqs. 1-12) and its multilevel extension.

Notation (Table I): ``D`` data bytes a rank dispatches, ``P_E`` expert bytes a rank holds (its
``n`` experts), ``B`` bandwidth, ``G`` ranks, ``p`` the share of a rank's ``G - 1`` outgoing data
chunks sent by all-to-all (the rest turn into all-gathers of the experts they were going to).

One level (the paper)::

    V_A2A = p (G-1) D / G           Lat_A2A = V_A2A / B             (Eq. 3)
    V_AG  = (1-p) (G-1) P_E         Lat_AG  = V_AG / B              (Eq. 4)
    Lat_comp = Lat_PE + n Lat_EP                                    (Eq. 2)
    Lat_comm = Lat_AG + 2 Lat_A2A                                   (Eq. 5)
    Lat_ovlp = min(Lat_PE, Lat_AG) + n Lat_EP                       (Eq. 7)
    Lat_final = Lat_comp + Lat_comm - Lat_ovlp                      (Eq. 8)
              = max(Lat_PE, Lat_AG) + 2 Lat_A2A                     (Eq. 10)

``search_p`` tries every ``p`` in ``{0, 1/(G-1), ..., 1}``; ``optimal_p`` uses the closed form
(Eqs. 11-12): ``Lat_final`` is convex and piecewise linear in ``p`` with its kink at
``p* = 1 - B Lat_PE / (P_E (G-1))``; case 1 (``Lat_PE >= Lat_AG``, ``p >= p*``) rises with
``p``; case 2 (``p < p*``) has slope ``(G-1)(2D - G P_E) / (B G)``: case 2.1 (``2D < G P_E``)
wants the largest ``p`` below the kink, case 2.2 (``2D >= G P_E``) wants ``p = 0``. The paper
states the continuous optimum; on the grid the answer is one of the grid points around ``p*``
(or 0), which is what ``optimal_p`` evaluates. Both break ties toward the smaller ``p``.

Several levels (``plan_domains``): a level ``l`` of ``SF^l`` members with domain size ``S^l``
has ``p_l = (SF^l - S^l) / (SF^l - 1)`` (Definition 1 with ``S^l - 1`` gathered peers). The
traffic of each level's all-gather and all-to-all (peers from
:class:`~moesaic.placement.topology.Topology`) is priced by :func:`moesaic.cluster.cost.network_time`
(busiest uplink, shared uplinks included) plus the level's one-way latency; gathers go outermost
level first so the slowest link carries the smallest bundle (``P_E prod_{j<l} S^j`` per peer);
tokens hop level by level to the same offset of the destination domain (``D S^l / SF^l`` per
peer). Then ``Lat_final = max(Lat_PE, sum Lat_AG) + 2 sum Lat_A2A``. On one level with zero
latency this equals the paper's formula (tested).

Torch-free, except :func:`measure_gemm_flops`, which imports torch when called.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from moesaic.checks import (
    check_int,
    check_non_negative,
    check_one_of,
    check_positive,
    check_positive_int,
)
from moesaic.cluster.cost import network_time
from moesaic.cluster.spec import ClusterSpec
from moesaic.config import MoEConfig
from moesaic.placement.compress import compressed_nbytes
from moesaic.placement.topology import Topology
from moesaic.strategies.hybrid_options import SHARED_EXPERTS

__all__ = [
    "DomainCandidate",
    "DomainPlan",
    "Latency",
    "PChoice",
    "StreamInputs",
    "evaluate_domains",
    "gemm_latency_s",
    "latency",
    "measure_gemm_flops",
    "optimal_p",
    "plan_domains",
    "search_p",
    "shared_expert_gathers",
    "stream_inputs",
]


class _HasDomains(Protocol):
    @property
    def domain_sizes(self) -> tuple[int, ...]: ...


T = TypeVar("T", bound=_HasDomains)
_TIE = 1e-12  # relative: two latencies this close are a tie, broken toward the smaller p


def gemm_latency_s(rows: int, inner: int, cols: int, flops_per_s: float) -> float:
    """Eq. 1: an ``(rows, inner) @ (inner, cols)`` GEMM at ``flops_per_s`` (2 FLOPs per MAC)."""
    check_int("rows", rows, 0)
    check_positive_int("inner", inner)
    check_positive_int("cols", cols)
    check_positive("flops_per_s", flops_per_s)
    return 2.0 * rows * inner * cols / flops_per_s


@dataclass(kw_only=True, slots=True, frozen=True)
class StreamInputs:
    """What the model needs from a model and a batch (Table I).

    Attributes:
        data_bytes: ``D``, bytes a rank dispatches per all-to-all (routed rows x H x dtype).
        expert_bytes: ``P_E``, bytes of the ``n`` experts a rank holds, as sent (compressed or not).
        pre_expert_s: ``Lat_comp^PE``, seconds of the computation before the experts.
        experts_per_rank: ``n``.
        expert_s: ``Lat_comp^EP``, seconds of one expert's computation (cancels in Eq. 8 since
            Eq. 7 overlaps it fully; kept so the parts can be reported).
    """

    data_bytes: float
    expert_bytes: float
    pre_expert_s: float
    experts_per_rank: int = 1
    expert_s: float = 0.0

    def __post_init__(self) -> None:
        check_positive("data_bytes", self.data_bytes)
        check_positive("expert_bytes", self.expert_bytes)
        check_non_negative("pre_expert_s", self.pre_expert_s)
        check_positive_int("experts_per_rank", self.experts_per_rank)
        check_non_negative("expert_s", self.expert_s)


@dataclass(kw_only=True, slots=True, frozen=True)
class Latency:
    """The parts of Eq. 8 at one ``p`` (seconds)."""

    p: float
    a2a_s: float
    ag_s: float
    comp_s: float
    comm_s: float
    overlap_s: float
    final_s: float


@dataclass(kw_only=True, slots=True, frozen=True)
class PChoice:
    """An optimum: ``p``, its predicted latency, the paper's case ("1", "2.1", "2.2")."""

    p: float
    latency_s: float
    case: str
    parts: Latency


def _check_level(num_ranks: int, bandwidth_gbps: float) -> float:
    check_int("num_ranks", num_ranks, 2)
    return check_positive("bandwidth_gbps", bandwidth_gbps) * 1e9 / 8  # bytes/s


def latency(inputs: StreamInputs, p: float, *, num_ranks: int, bandwidth_gbps: float) -> Latency:
    """Eqs. 2-8 at share ``p`` (any real in [0, 1]; the grid is ``k / (G-1)``)."""
    B = _check_level(num_ranks, bandwidth_gbps)
    check_non_negative("p", p)
    if p > 1:
        raise ValueError(f"p ({p}) must be in [0, 1]")
    G, D, PE = num_ranks, inputs.data_bytes, inputs.expert_bytes
    a2a_s = p * (G - 1) * D / G / B
    ag_s = (1 - p) * (G - 1) * PE / B
    expert_total_s = inputs.experts_per_rank * inputs.expert_s
    comp_s = inputs.pre_expert_s + expert_total_s
    comm_s = ag_s + 2 * a2a_s
    overlap_s = min(inputs.pre_expert_s, ag_s) + expert_total_s
    return Latency(
        p=p,
        a2a_s=a2a_s,
        ag_s=ag_s,
        comp_s=comp_s,
        comm_s=comm_s,
        overlap_s=overlap_s,
        final_s=comp_s + comm_s - overlap_s,
    )


def _case(inputs: StreamInputs, parts: Latency, num_ranks: int) -> str:
    if inputs.pre_expert_s >= parts.ag_s:
        return "1"
    return "2.1" if 2 * inputs.data_bytes < num_ranks * inputs.expert_bytes else "2.2"


def _best(inputs: StreamInputs, ks: list[int], num_ranks: int, bandwidth_gbps: float) -> PChoice:
    parts = [
        latency(inputs, k / (num_ranks - 1), num_ranks=num_ranks, bandwidth_gbps=bandwidth_gbps)
        for k in sorted(set(ks))
    ]
    low = min(x.final_s for x in parts)
    chosen = next(x for x in parts if x.final_s <= low * (1 + _TIE))  # smallest p among ties
    return PChoice(
        p=chosen.p, latency_s=chosen.final_s, case=_case(inputs, chosen, num_ranks), parts=chosen
    )


def search_p(inputs: StreamInputs, *, num_ranks: int, bandwidth_gbps: float) -> PChoice:
    """Exhaustive: the best ``p`` of ``{0, 1/(G-1), ..., 1}`` (ties: the smaller ``p``)."""
    _check_level(num_ranks, bandwidth_gbps)
    return _best(inputs, list(range(num_ranks)), num_ranks, bandwidth_gbps)


def optimal_p(inputs: StreamInputs, *, num_ranks: int, bandwidth_gbps: float) -> PChoice:
    """Closed form (Eqs. 10-12) on the grid of ``p``; agrees with :func:`search_p`.

    Case 2.2 (``2D >= G P_E``) gives ``p = 0``; otherwise the optimum sits at the kink
    ``p* = 1 - B Lat_PE / (P_E (G-1))`` clipped to [0, 1], i.e. at the grid point just below it
    (case 2.1) or just above it (case 1), whichever is faster.
    """
    B = _check_level(num_ranks, bandwidth_gbps)
    G = num_ranks
    kink = 1 - B * inputs.pre_expert_s / (inputs.expert_bytes * (G - 1))
    kink_k = min(max(kink, 0.0), 1.0) * (G - 1)
    ks = [0, math.floor(kink_k), math.ceil(kink_k)]
    return _best(inputs, [min(max(k, 0), G - 1) for k in ks], G, bandwidth_gbps)


# ---------------------------------------------------------------------------------- inputs
def shared_expert_gathers(
    dense: StreamInputs,
    domain_sizes: Sequence[int],
    level_sizes: Sequence[int],
    *,
    compressed: bool,
    scope: str = "domain",
) -> list[tuple[StreamInputs, tuple[int, ...]]]:
    """The shared expert's all-reduce of a compressed gather, as gathers to price: pairs of
    (inputs whose ``expert_bytes`` is what each peer sends, the group's size per level), each
    priced as the gathers of ``domain_sizes`` are (the simulator's ``sim.hybrid._phases``, the
    planner's ``evaluate_domains``), to be divided by ``shared_expert_every``.

    An all-reduce of one dense expert over n ranks is a reduce-scatter and an all-gather of
    ``1/n`` of it each: a gather of ``2 * expert / n`` per peer. ``scope`` is
    ``HybridOptions.shared_expert``: "domain" all-reduces over the domain (``domain_sizes``,
    S ranks); "all" adds the offset group (one rank per domain: ``level_size / S^l`` ranks per
    level, W / S in all), as the runtime issues it (``HybridStrategy._shared_groups``);
    "none" has no shared expert. Nothing when the gather is exact (``compressed`` False) or
    a group has one rank.
    """
    check_one_of("scope", scope, SHARED_EXPERTS)
    if not compressed or scope == "none":
        return []
    one = dense.expert_bytes / dense.experts_per_rank
    offset = tuple(n // s for s, n in zip(domain_sizes, level_sizes, strict=True))
    groups = [tuple(domain_sizes)] + ([offset] if scope == "all" else [])
    return [
        (dataclasses.replace(dense, expert_bytes=2 * one / math.prod(sizes)), sizes)
        for sizes in groups
        if math.prod(sizes) > 1
    ]


def stream_inputs(
    config: MoEConfig,
    *,
    tokens_per_rank: int,
    ep_size: int,
    flops_per_s: float,
    act_bytes: int = 2,
    param_bytes: int = 2,
    compression_ratio: float = 1.0,
    pre_expert_flops: float | None = None,
    seq_len: int | None = None,
    dense_blocks_before: int = 0,
    dense_ffn_hidden_size: int | None = None,
) -> StreamInputs:
    """Derives ``D``, ``P_E``, ``Lat_comp^PE``, ``n`` and ``Lat_comp^EP`` from a model and batch.

    Args:
        config: The MoE layer (H, F, E, K, activation).
        tokens_per_rank: T, tokens each rank feeds the layer (batch x sequence).
        ep_size: G, ranks of the expert-parallel group.
        flops_per_s: C, a rank's GEMM throughput (given, or from :func:`measure_gemm_flops`).
        act_bytes: Bytes per activation element on the wire.
        param_bytes: Bytes per expert parameter.
        compression_ratio: SR compression ratio CR of the gathered experts (1: none).
        pre_expert_flops: FLOPs before the experts; None estimates them per Eq. 2 as
            ``(m+1)`` attention blocks (QKV/O projections ``8 T H^2``, scores and weighted sum
            ``4 T seq H``) plus ``m`` dense FFNs and the router (``2 T H E``),
            ``m = dense_blocks_before``.
        seq_len: Sequence length for the attention estimate (default: ``tokens_per_rank``).
        dense_blocks_before: ``m``, dense transformer blocks before this MoE block.
        dense_ffn_hidden_size: Their FFN width (default: ``config.ffn_hidden_size``).
    """
    check_positive_int("tokens_per_rank", tokens_per_rank)
    config.check_ep_size(ep_size)
    check_positive("flops_per_s", flops_per_s)
    check_positive_int("act_bytes", act_bytes)
    check_positive_int("param_bytes", param_bytes)
    check_int("dense_blocks_before", dense_blocks_before, 0)
    H, F, E, K, T = (
        config.hidden_size,
        config.ffn_hidden_size,
        config.num_experts,
        config.top_k,
        tokens_per_rank,
    )
    mats = 3 if config.activation == "swiglu" else 2  # (w1, w3, w2) or (w1, w2)
    n = E // ep_size
    expert_nbytes = mats * compressed_nbytes(H * F, compression_ratio, param_bytes)
    rows_per_expert = ep_size * T * K / E  # uniform routing (the paper's assumption)
    expert_s = mats * 2.0 * rows_per_expert * H * F / flops_per_s
    if pre_expert_flops is None:
        seq = T if seq_len is None else check_positive_int("seq_len", seq_len)
        dense_f = F if dense_ffn_hidden_size is None else dense_ffn_hidden_size
        check_positive_int("dense_ffn_hidden_size", dense_f)
        attention = 8.0 * T * H * H + 4.0 * T * seq * H
        dense_ffn = mats * 2.0 * T * H * dense_f
        pre_expert_flops = (
            (dense_blocks_before + 1) * attention
            + dense_blocks_before * dense_ffn
            + 2.0 * T * H * E
        )
    check_non_negative("pre_expert_flops", pre_expert_flops)
    return StreamInputs(
        data_bytes=float(T * K * H * act_bytes),
        expert_bytes=float(n * expert_nbytes),
        pre_expert_s=pre_expert_flops / flops_per_s,
        experts_per_rank=n,
        expert_s=expert_s,
    )


def measure_gemm_flops(size: int = 1024, *, repeats: int = 5, dtype: str = "float32") -> float:
    """Median FLOP/s of a ``size x size`` matmul on the CPU (for ``stream_inputs``).

    A few milliseconds of work; tests pass given rates instead.
    """
    import time

    import torch

    check_positive_int("size", size)
    check_positive_int("repeats", repeats)
    a = torch.randn(size, size, dtype=getattr(torch, dtype))
    b = torch.randn(size, size, dtype=getattr(torch, dtype))
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / sorted(times)[len(times) // 2]


# ------------------------------------------------------------------------------- multilevel
@dataclass(kw_only=True, slots=True, frozen=True)
class DomainCandidate:
    """One choice of domain sizes and its predicted latency (seconds).

    Attributes:
        domain_sizes: ``S^l`` per level, outermost first.
        p: ``p_l = (SF^l - S^l) / (SF^l - 1)`` per level (1.0 for a level of size 1).
        ag_s: ``[Lat_AG at level l]``.
        a2a_s: ``[Lat_A2A at level l]`` (one of the two all-to-alls).
        final_s: ``max(Lat_PE, sum ag_s) + 2 sum a2a_s``.
    """

    domain_sizes: tuple[int, ...]
    p: tuple[float, ...]
    ag_s: tuple[float, ...]
    a2a_s: tuple[float, ...]
    final_s: float


@dataclass(kw_only=True, slots=True, frozen=True)
class DomainPlan:
    """The result of :func:`plan_domains`: every candidate, the chosen one and why."""

    chosen: DomainCandidate
    classic: DomainCandidate
    candidates: tuple[DomainCandidate, ...]
    reason: str


def evaluate_domains(
    spec: ClusterSpec, inputs: StreamInputs, domain_sizes: tuple[int, ...] | list[int]
) -> DomainCandidate:
    """Predicted latency of HybridEP with ``domain_sizes`` on ``spec`` (see module docstring)."""
    topo = Topology.from_cluster(spec, domain_sizes)
    ag_s, a2a_s, ps = [], [], []
    for level, lv in enumerate(spec.levels):
        sf, s = lv.size, topo.domain_sizes[level]
        ps.append(1.0 if sf == 1 else (sf - s) / (sf - 1))
        lat_s = lv.latency_ms * 1e-3
        bundle = inputs.expert_bytes * math.prod(topo.domain_sizes[:level])
        ag_s.append(_phase_s(spec, topo, level, "AG", bundle, lat_s) if s > 1 else 0.0)
        per_peer = inputs.data_bytes * s / sf
        a2a_s.append(_phase_s(spec, topo, level, "A2A", per_peer, lat_s) if s < sf else 0.0)
    return DomainCandidate(
        domain_sizes=topo.domain_sizes,
        p=tuple(ps),
        ag_s=tuple(ag_s),
        a2a_s=tuple(a2a_s),
        final_s=max(inputs.pre_expert_s, sum(ag_s)) + 2 * sum(a2a_s),
    )


def _phase_s(
    spec: ClusterSpec, topo: Topology, level: int, kind: str, per_peer: float, lat_s: float
) -> float:
    P = spec.world_size
    bytes_PP = [[0.0] * P for _ in range(P)]
    for m in range(P):
        for n in topo.peers(m, level, "AG" if kind == "AG" else "A2A"):
            bytes_PP[m][n] = per_peer
    return network_time(spec, bytes_PP).bandwidth_s + lat_s


def domain_size_choices(spec: ClusterSpec) -> list[tuple[int, ...]]:
    """Every tuple of domain sizes for ``spec`` (each ``S^l`` a divisor of its level's size),
    classic EP (all 1) first."""
    divisors = [[d for d in range(1, lv.size + 1) if lv.size % d == 0] for lv in spec.levels]
    return list(itertools.product(*divisors))


def fastest_smallest(candidates: Sequence[T], time_s: Callable[[T], float]) -> T:
    """The candidate with the least ``time_s``; ties (within ``_TIE``) go to the smaller domains
    (fewer gathered experts), then to the smaller outer sizes."""
    low = min(time_s(c) for c in candidates)
    ties = [c for c in candidates if time_s(c) <= low * (1 + _TIE)]
    return min(ties, key=lambda c: (math.prod(c.domain_sizes), c.domain_sizes))


def plan_domains(spec: ClusterSpec, inputs: StreamInputs) -> DomainPlan:
    """Evaluates every domain-size tuple (each ``S^l`` a divisor of its level's size).

    The fastest wins; ties go to the smaller domains (less gathered state). The classic-EP
    candidate (all ``S^l = 1``) is always among them, so the chosen one is never predicted slower.
    """
    candidates = tuple(evaluate_domains(spec, inputs, ds) for ds in domain_size_choices(spec))
    chosen = fastest_smallest(candidates, lambda c: c.final_s)
    classic = candidates[0]
    gather_s = sum(chosen.ag_s)
    if chosen is classic:
        why = "moving experts costs more than the tokens they save"
    elif gather_s <= inputs.pre_expert_s:
        why = f"the expert gathers ({gather_s:.3g} s) hide under pre-expert compute"
    else:
        why = f"gathering experts ({gather_s:.3g} s) beats moving tokens twice"
    reason = (
        f"domains {list(chosen.domain_sizes)} predict {chosen.final_s:.3g} s vs classic EP "
        f"{classic.final_s:.3g} s ({classic.final_s / chosen.final_s:.2f}x): {why}"
    )
    return DomainPlan(chosen=chosen, classic=classic, candidates=candidates, reason=reason)
