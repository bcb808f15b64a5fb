"""FSDP2's traffic in a training step (``--dp-shard``, ``train/fsdp.py``), priced on the
cluster's levels. Torch-free.

**The layout** (``train/fsdp.py``): ``world = dp_replicate x dp_shard x ep``, EP innermost.
Each block's dense unit (attention, norms, its router) is sharded over the dense mesh, the
``dp_shard x ep`` consecutive ranks of a replica; each block's experts (an EP rank's ``E / ep``)
over the expert mesh, the ``dp_shard`` ranks beside an EP rank (they differ only in the levels
outside EP's); the root (embedding, final norm, tied head) over the dense mesh.

**What a step moves** (FSDP2 with ``reshard_after_forward``, its default): every block unit is
all-gathered before each pass over the block (vanilla: one pass; a pipelined schedule calls
each chunk's stages, so R passes) and again before each pass of its backward, and its
gradients are reduce-scattered after each backward pass; the root is gathered once and stays
gathered through the backward, its gradients reduce-scattered once at the end. An all-gather
of a shard ``s`` over ``g`` ranks and the reduce-scatter of the full gradients ``g s`` move the
same ``(g - 1) s`` per rank, so where the backend reduce-scatters (NCCL) both are priced as the
all-gather: :func:`all_gather_s` on the dense mesh's levels, :func:`level_exchange_s` (a
gather) on the expert mesh's one level. gloo has no reduce-scatter: ``ProcessGroupGloo``'s
``reduce_scatter_tensor`` clones the whole input, all-reduces it and keeps its chunk, moving
twice those bytes, so there (:func:`reduce_scatter_all_reduces`: a profile measured on the
CPU, whose collectives ran on gloo) the reduce is priced as that all-reduce: the dense unit's
over the dense mesh (:func:`all_reduce_s`), the experts' over their one level.

**Replicas** (HSDP, ``dp_replicate`` > 1: ``world = dp_replicate x dp_shard x ep``, the
replicas outermost): gathers stay inside a replica; after each reduce-scatter FSDP2
all-reduces the unit's gradient shard over the ``dp_replicate`` ranks that hold the same shard
(one per replica, on the levels outside the replica's), priced by
:func:`replicas_all_reduce_s` (on one level a reduce-scatter and an all-gather of the shard,
:func:`level_exchange_s` each; across several, gloo's ring) and added to the unit's reduce;
the root's likewise.

**Overlap** (:mod:`moesaic.sim.pipelined` puts these on a lane of their own, ``FSDP``, in
issue order): with FSDP2's explicit prefetch (on under ``vanilla``; off under the pipelined
schedules, ``train/fsdp.py``), block ``l + 1``'s gathers are issued when block ``l``'s
forward starts and block ``l - 1``'s when block ``l``'s backward starts, so they run beside
the compute; without it each gather is issued when its pass starts and the pass waits for it.
The sharded gradients need no all-reduce (``dp_replicate`` 1): the optimizer step waits for
the last reduce-scatter. Not modelled: the FSDP lane's bytes sharing a link with the
all-to-alls in flight (as FlowMoE's gradient chunks, ``sim.pipelined``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moesaic.checks import check_positive_int
from moesaic.cluster.spec import ClusterSpec
from moesaic.sim.collectives import LinkModel, all_gather_s, all_reduce_s, level_exchange_s
from moesaic.sim.model import ModelSpec

__all__ = [
    "FSDP",
    "FsdpTraffic",
    "fsdp_traffic",
    "inner_link",
    "mesh_levels",
    "reduce_scatter_all_reduces",
    "replica_reduce_s",
    "replicas_all_reduce_s",
    "sharded_fraction",
]

FSDP = "fsdp"  # the engine lane of FSDP2's all-gathers and reduce-scatters


@dataclass(frozen=True, slots=True)
class FsdpTraffic:
    """One step's FSDP2 collectives on the representative rank.

    Attributes:
        gather_s: one pass's all-gathers of one block's units (dense unit and experts).
        reduce_s: one backward pass's reduce-scatters of one block's gradients.
        root_gather_s: the root's all-gather (once per step).
        root_reduce_s: the root's reduce-scatter (once, after the backward).
        gather_bytes: bytes a rank receives in one block's gathers (one pass).
        root_bytes: bytes a rank receives in the root's gather.
        reduce_bytes: bytes a rank sends in one backward pass's reduce-scatters of one block
            (``gather_bytes``; twice that where the backend all-reduces instead).
        root_reduce_bytes: the same for the root's.
        prefetch: FSDP2's explicit prefetch (the next block's gathers beside this one's compute).
        dense_ranks: ranks the dense units are sharded over (``dp_shard x ep``).
    """

    gather_s: float
    reduce_s: float
    root_gather_s: float
    root_reduce_s: float
    gather_bytes: float
    root_bytes: float
    reduce_bytes: float
    root_reduce_bytes: float
    prefetch: bool
    dense_ranks: int


def mesh_levels(spec: ClusterSpec, ranks: int, *, inner: int = 1) -> tuple[int, ...]:
    """The levels (by index) whose members a mesh dimension of ``ranks`` consecutive groups
    of ``inner`` ranks spans: from the innermost level outward, past the levels that hold the
    ``inner`` ranks, the levels whose sizes multiply to ``ranks``.

    Raises:
        ValueError: ``inner`` or ``ranks`` not a product of whole levels, named with the sizes.
    """
    check_positive_int("ranks", ranks)
    check_positive_int("inner", inner)
    sizes = [level.size for level in spec.levels]
    j, acc = len(sizes), 1
    while acc < inner and j > 0:
        j -= 1
        acc *= sizes[j]
    if acc != inner:
        raise ValueError(
            f"ep ({inner}) must be a product of the innermost levels' sizes {sizes[::-1]} "
            "(FSDP2's meshes are priced on whole levels)"
        )
    out, acc = [], 1
    while acc < ranks and j > 0:
        j -= 1
        acc *= sizes[j]
        out.append(j)
    if acc != ranks:
        raise ValueError(
            f"the mesh of {ranks} ranks beside ep ({inner}) must be a product of whole levels' "
            f"sizes {sizes[::-1]} (innermost first)"
        )
    return tuple(sorted(out))


def inner_link(link: LinkModel, ranks: int) -> LinkModel:
    """``link`` restricted to one group of ``ranks`` consecutive ranks: its innermost levels
    whose sizes multiply to ``ranks`` (:func:`mesh_levels`), with their measured figures (an
    EP group inside a sharded world, a dense mesh inside the cluster)."""
    if ranks == link.world_size:
        return link
    levels = mesh_levels(link.spec, ranks)
    k = levels[0] if levels else len(link.spec.levels) - 1
    spec = link.spec
    if not levels:  # one rank: the innermost level at size 1
        last = spec.levels[-1]
        sub = ClusterSpec(levels=(dataclasses.replace(last, size=1),), name=spec.name)
        return dataclasses.replace(link, spec=sub, level_shares=())
    sub = ClusterSpec(levels=spec.levels[k:], name=spec.name)
    return dataclasses.replace(link, spec=sub, level_shares=link.level_shares[k:])


def reduce_scatter_all_reduces(device: str) -> bool:
    """Whether the collectives of a profile measured on ``device`` ran on a backend whose
    reduce-scatter is an all-reduce of the whole tensor: gloo, which ``moesaic train`` runs for
    CPU tensors (``comm/world.py``; NCCL for CUDA ones, which reduce-scatters)."""
    return device == "cpu"


def _dense_all_reduce_s(link: LinkModel, ranks: int, nbytes: float) -> float:
    """An all-reduce of ``nbytes`` per rank over ``ranks`` consecutive ranks (the innermost
    levels), ``link``'s algorithm on those levels' links."""
    if ranks < 2 or nbytes == 0:
        return 0.0
    return all_reduce_s(inner_link(link, ranks), nbytes)


def _dense_gather_s(link: LinkModel, ranks: int, shard_bytes: float) -> float:
    """An all-gather of ``shard_bytes`` per rank over ``ranks`` consecutive ranks (the
    innermost levels): the ring all-gather on those levels' links."""
    if ranks < 2 or shard_bytes == 0:
        return 0.0
    return all_gather_s(inner_link(link, ranks), shard_bytes)


def fsdp_traffic(
    link: LinkModel,
    model: ModelSpec,
    *,
    ep: int,
    dp_shard: int,
    prefetch: bool,
    dp_replicate: int = 1,
    all_reduce_scatter: bool = False,
) -> FsdpTraffic:
    """The FSDP2 collectives of ``model`` with ``dp_shard`` beside ``ep`` on ``link``'s
    cluster (its world: ``dp_replicate x dp_shard x ep`` ranks, the replicas outermost), fp32
    parameters (``model.param_bytes``); ``all_reduce_scatter``: the backend reduce-scatters by
    an all-reduce (gloo: :func:`reduce_scatter_all_reduces`)."""
    check_positive_int("ep", ep)
    check_positive_int("dp_shard", dp_shard)
    check_positive_int("dp_replicate", dp_replicate)
    if dp_replicate * dp_shard * ep != link.world_size:
        raise ValueError(
            f"dp_replicate ({dp_replicate}) x dp_shard ({dp_shard}) x ep ({ep}) must be the "
            f"world size ({link.world_size})"
        )
    if model.experts % ep:
        raise ValueError(f"model.experts ({model.experts}) must be a multiple of ep ({ep})")
    dense_ranks = dp_shard * ep
    block = model.replicated_params_per_block() * model.param_bytes
    root = model.outer_params() * model.param_bytes
    experts = model.experts // ep * model.mats * model.hidden * model.ffn_hidden
    experts *= model.param_bytes
    dense_s = _dense_gather_s(link, dense_ranks, block / dense_ranks)
    root_s = _dense_gather_s(link, dense_ranks, root / dense_ranks)
    expert_s = expert_reduce_s = 0.0
    if dp_shard > 1:
        (level,) = _one_level(mesh_levels(link.spec, dp_shard, inner=ep), "dp_shard", dp_shard)
        expert_s = level_exchange_s(link, level, dp_shard - 1, experts / dp_shard, gather=True)
        expert_reduce_s = expert_s
        if all_reduce_scatter:
            expert_reduce_s = _level_all_reduce_s(link, level, dp_shard, experts)
    dense_reduce_s, root_reduce_s = dense_s, root_s
    if all_reduce_scatter:
        dense_reduce_s = _dense_all_reduce_s(link, dense_ranks, block)
        root_reduce_s = _dense_all_reduce_s(link, dense_ranks, root)
    replica_s = root_replica_s = 0.0
    if dp_replicate > 1:
        levels = mesh_levels(link.spec, dp_replicate, inner=dense_ranks)
        unit_shard = block / dense_ranks + experts / dp_shard
        replica_s = replicas_all_reduce_s(link, levels, dense_ranks, unit_shard)
        root_replica_s = replicas_all_reduce_s(link, levels, dense_ranks, root / dense_ranks)
    share = (dense_ranks - 1) / dense_ranks
    sent = 2 if all_reduce_scatter else 1  # an all-reduce sends twice a reduce-scatter's bytes
    gather_bytes = block * share + (experts * (dp_shard - 1) / dp_shard if dp_shard > 1 else 0)
    return FsdpTraffic(
        gather_s=dense_s + expert_s,
        reduce_s=dense_reduce_s + expert_reduce_s + replica_s,
        root_gather_s=root_s,
        root_reduce_s=root_reduce_s + root_replica_s,
        gather_bytes=gather_bytes,
        root_bytes=root * share,
        prefetch=prefetch,
        dense_ranks=dense_ranks,
        reduce_bytes=gather_bytes * sent,
        root_reduce_bytes=root * share * sent,
    )


def replica_reduce_s(link: LinkModel, model: ModelSpec, *, ep: int, dp_replicate: int) -> float:
    """The gradient reduction of ``dp_replicate`` replicas of the unsharded model with EP on
    the innermost ``ep`` ranks of ``link``'s world (``train/parallel.py``'s ``GradientSync``,
    one call after the other): the replicated (dense) gradients all-reduced over the world,
    then each rank's experts' over the ``dp_replicate`` ranks holding the same experts (one
    per replica, on the levels outside EP's: :func:`replicas_all_reduce_s`)."""
    check_positive_int("ep", ep)
    check_positive_int("dp_replicate", dp_replicate)
    if dp_replicate * ep != link.world_size:
        raise ValueError(
            f"dp_replicate ({dp_replicate}) x ep ({ep}) must be the world size ({link.world_size})"
        )
    dense = model.layers * model.replicated_params_per_block() + model.outer_params()
    experts = model.layers * model.experts // ep * model.mats * model.hidden * model.ffn_hidden
    dense_s = all_reduce_s(link, dense * model.param_bytes) if dense else 0.0
    levels = mesh_levels(link.spec, dp_replicate, inner=ep)
    return dense_s + replicas_all_reduce_s(link, levels, ep, experts * model.param_bytes)


def _one_level(levels: tuple[int, ...], name: str, degree: int) -> tuple[int]:
    if len(levels) != 1:
        raise ValueError(
            f"{name} ({degree}) must span one level of the cluster beside the ranks inside it "
            f"(its mesh is priced as one level's exchange); it spans levels {list(levels)}"
        )
    return (levels[0],)


def replicas_all_reduce_s(
    link: LinkModel, levels: tuple[int, ...], inner: int, nbytes: float
) -> float:
    """The all-reduce of ``nbytes`` per rank over the replicas that hold the same shard: the
    ranks that differ only in ``levels``' coordinates (:func:`mesh_levels` beside ``inner``
    ranks), ``inner`` such groups reducing at once.

    Inside one level, that level's exchange (:func:`_level_all_reduce_s`, its measured share;
    validated at two replicas, ``docs/simulator.md``). Across several levels, gloo's ring over
    the group in rank order (:func:`_spanning_ring_all_reduce_s`); at ``inner`` 1 over every
    level it is the world's ring (``collectives.ring_all_reduce_s``)."""
    ranks = 1
    for j in levels:
        ranks *= link.spec.levels[j].size
    if ranks < 2:
        return 0.0
    if len(levels) == 1:
        return _level_all_reduce_s(link, levels[0], ranks, nbytes)
    return _spanning_ring_all_reduce_s(link, levels, inner, ranks, nbytes)


def _spanning_ring_all_reduce_s(
    link: LinkModel, levels: tuple[int, ...], inner: int, ranks: int, nbytes: float
) -> float:
    """gloo's ring all-reduce over ``ranks`` replicas spanning ``levels``, ``inner`` rings at
    once (one per position inside a replica): ``2 (ranks - 1)`` steps of ``nbytes / ranks``,
    each as slow as its most loaded uplink and paying the outermost level's latency.

    In rank order a ring leaves each member of a spanned level once, so such a member's uplink
    carries ``inner`` flows a step; inside the ``inner`` ranks every rank's successor is in
    another member, so a member there sends all its ``ranks_per_member`` ranks' chunks."""
    chunk = nbytes / ranks
    steps = 2 * (ranks - 1)
    outer = min(levels)
    worst = 0.0
    for j in range(outer, link.spec.num_levels):
        flows = inner if j in levels else link.ranks_per_member(j)
        worst = max(worst, flows * chunk / link.bytes_per_s(j))
    bandwidth = steps * worst / link.share("all_reduce", nbytes)
    return bandwidth + max(steps * link.latency_s(outer), link.allreduce_call_s)


def _level_all_reduce_s(link: LinkModel, level: int, ranks: int, nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` per rank over ``ranks`` ranks that differ only in
    ``level``'s coordinate: a reduce-scatter and an all-gather of ``nbytes / ranks`` each."""
    return 2 * level_exchange_s(link, level, ranks - 1, nbytes / ranks, gather=True)


def sharded_fraction(model: ModelSpec, ep: int, dp_shard: int) -> float:
    """The share of a rank's unsharded parameters (dense whole, its ``E / ep`` experts) that
    it holds sharded: what its optimizer step updates."""
    dense = model.layers * model.replicated_params_per_block() + model.outer_params()
    experts = model.layers * model.experts // ep * model.mats * model.hidden * model.ffn_hidden
    return (dense / (dp_shard * ep) + experts / dp_shard) / (dense + experts)
