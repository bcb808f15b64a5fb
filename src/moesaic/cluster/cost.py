"""Network time of a traffic pattern on a :class:`~moesaic.cluster.spec.ClusterSpec`.

One model, used by every network estimate in moesaic (the cluster check's collective bounds,
``moesaic bench layer --cluster``'s network bound, the coming cost model and simulator):

* **Bandwidth.** Every member of every level (a datacenter, a node, a rank) joins its parent's
  switch through one uplink of that level's ``bandwidth_gbps`` per direction. All bytes its ranks
  send to ranks outside it go up that uplink, all bytes they receive from outside come down it.
  The busiest uplink direction of any level bounds the time: ``max bytes * 8 / bandwidth``.
* **Latency.** Each collective waits at least the one-way latency of the slowest path in the
  world (the outermost level that separates some ranks), one collective after another.

``time = busiest uplink's bytes / its bandwidth + collectives x worst one-way latency``. It is a
lower bound: it assumes perfect overlap of all transfers and no software overhead. The emulated
cluster measures collectives at 1.1-1.4x it (see docs/cluster.md).

The traffic is a ``P x P`` matrix of bytes, ``bytes_PP[src][dst]`` (each rank's ``peer_bytes_P``
stacked: row ``src`` is what ``src`` sends); the diagonal never crosses the network and is
ignored. Torch-free: rows may be lists, tuples or anything with ``tolist()``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moesaic.checks import check_int, is_number
from moesaic.cluster.spec import ClusterSpec

__all__ = [
    "NetworkTime",
    "all_to_all_bytes",
    "all_to_all_time_s",
    "collective_latency_s",
    "network_time",
    "ring_all_reduce_time_s",
    "ring_step_bytes",
    "traffic_time_s",
    "uplink_bytes",
]


@dataclass(kw_only=True, slots=True, frozen=True)
class NetworkTime:
    """The parts of :func:`network_time`.

    Attributes:
        bandwidth_s: Bytes of the busiest uplink direction divided by its bandwidth.
        latency_s: ``collectives`` x the worst one-way path latency.
        busiest_level: Index of the level whose uplink sets ``bandwidth_s`` (None: no traffic
            crosses the network).
        busiest_bytes: Bytes on that uplink in its busier direction.
    """

    bandwidth_s: float
    latency_s: float
    busiest_level: int | None
    busiest_bytes: float

    @property
    def total_s(self) -> float:
        return self.bandwidth_s + self.latency_s


def _matrix(spec: ClusterSpec, bytes_PP: Any) -> list[list[float]]:
    """``bytes_PP`` as a list of P rows of P finite non-negative numbers (ValueError if not)."""
    if hasattr(bytes_PP, "tolist"):
        bytes_PP = bytes_PP.tolist()
    P = spec.world_size
    if not isinstance(bytes_PP, Sequence) or len(bytes_PP) != P:
        got = len(bytes_PP) if isinstance(bytes_PP, Sequence) else type(bytes_PP).__name__
        raise ValueError(f"bytes_PP must have world_size ({P}) rows, got {got}")
    rows = []
    for src, row in enumerate(bytes_PP):
        if hasattr(row, "tolist"):
            row = row.tolist()
        if not isinstance(row, Sequence) or len(row) != P:
            raise ValueError(f"bytes_PP[{src}] must have world_size ({P}) entries")
        for dst, value in enumerate(row):
            if not is_number(value) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"bytes_PP[{src}][{dst}] ({value!r}) must be a finite number of bytes >= 0"
                )
        rows.append(list(row))
    return rows


def uplink_bytes(spec: ClusterSpec, bytes_PP: Any) -> list[list[tuple[float, float]]]:
    """Bytes on every uplink: ``out[level][group] = (up, down)``.

    ``up`` is what the member's ranks send to ranks outside it, ``down`` what they receive from
    outside it.
    """
    rows = _matrix(spec, bytes_PP)
    P = spec.world_size
    out = []
    for level in range(spec.num_levels):
        per_group = spec.ranks_per_group(level)
        up = [0.0] * spec.num_groups(level)
        down = [0.0] * spec.num_groups(level)
        for src in range(P):
            g_src = src // per_group
            for dst, nbytes in enumerate(rows[src]):
                g_dst = dst // per_group
                if nbytes and g_src != g_dst:
                    up[g_src] += nbytes
                    down[g_dst] += nbytes
        out.append(list(zip(up, down)))
    return out


def collective_latency_s(spec: ClusterSpec) -> float:
    """The worst one-way path latency in the world, seconds (0 for a single rank).

    Rank 0 is separated from some rank at every level of size > 1, so its paths cover them all.
    """
    P = spec.world_size
    return max((spec.path(0, b).latency_ms for b in range(1, P)), default=0.0) * 1e-3


def network_time(spec: ClusterSpec, bytes_PP: Any, *, collectives: int = 0) -> NetworkTime:
    """Lower bound on the network time of a traffic matrix, with its parts.

    Args:
        spec: The cluster.
        bytes_PP: ``bytes_PP[src][dst]``, bytes ``src`` sends to ``dst`` (P x P, diagonal ignored).
        collectives: Collectives the traffic is issued in, one after another; each costs the
            worst one-way path latency.

    Raises:
        ValueError: If the matrix is not P x P of finite numbers >= 0 or ``collectives`` < 0.
    """
    check_int("collectives", collectives, 0)
    bandwidth_s, busiest_level, busiest_bytes = 0.0, None, 0.0
    for level, groups in enumerate(uplink_bytes(spec, bytes_PP)):
        worst = max(max(up, down) for up, down in groups)
        seconds = worst * 8 / (spec.levels[level].bandwidth_gbps * 1e9)
        if worst > 0 and seconds > bandwidth_s:
            bandwidth_s, busiest_level, busiest_bytes = seconds, level, worst
    return NetworkTime(
        bandwidth_s=bandwidth_s,
        latency_s=collectives * collective_latency_s(spec),
        busiest_level=busiest_level,
        busiest_bytes=busiest_bytes,
    )


def traffic_time_s(spec: ClusterSpec, bytes_PP: Any, *, collectives: int = 0) -> float:
    """Seconds: busiest uplink's bytes / its bandwidth + ``collectives`` x worst latency.

    The one public network estimate; see :func:`network_time` for the arguments and the parts.
    """
    return network_time(spec, bytes_PP, collectives=collectives).total_s


def all_to_all_bytes(world_size: int, bytes_per_pair: float) -> list[list[float]]:
    """The matrix of an all-to-all moving ``bytes_per_pair`` between every ordered pair."""
    return [
        [0.0 if a == b else float(bytes_per_pair) for b in range(world_size)]
        for a in range(world_size)
    ]


def ring_step_bytes(world_size: int, chunk_bytes: float) -> list[list[float]]:
    """The matrix of one ring step: every rank ``k`` sends ``chunk_bytes`` to ``k + 1 mod P``."""
    out = [[0.0] * world_size for _ in range(world_size)]
    for k in range(world_size):
        if world_size > 1:
            out[k][(k + 1) % world_size] = float(chunk_bytes)
    return out


def all_to_all_time_s(spec: ClusterSpec, bytes_per_pair: float) -> float:
    """Lower bound on one all-to-all moving ``bytes_per_pair`` between every ordered rank pair."""
    P = spec.world_size
    return traffic_time_s(spec, all_to_all_bytes(P, bytes_per_pair), collectives=1 if P > 1 else 0)


def ring_all_reduce_time_s(spec: ClusterSpec, bytes_per_rank: float) -> float:
    """Lower bound on a ring all-reduce of ``bytes_per_rank`` over ranks 0..P-1.

    gloo's algorithm for large tensors: ``2 (P - 1)`` steps (reduce-scatter, then all-gather),
    each sending ``bytes / P`` along every ring edge ``k -> k+1`` and waiting for the slowest
    edge; each step is one :func:`traffic_time_s` with one collective's latency.
    """
    P = spec.world_size
    if P < 2:
        return 0.0
    step_s = traffic_time_s(spec, ring_step_bytes(P, bytes_per_rank / P), collectives=1)
    return 2 * (P - 1) * step_s
