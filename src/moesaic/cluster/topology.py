"""The emulated network as data: namespaces, bridges, links, addresses and shaping parameters.

Pure functions of a :class:`~moesaic.cluster.spec.ClusterSpec`; :mod:`moesaic.cluster.netns`
turns the plan into ``ip``/``tc`` commands. Keeping the plan separate lets it be unit-tested
without root and lets a simulator read the same link list.

Layout for levels ``L0 .. L(n-1)`` (outermost first)::

    fabric namespace  msc-<id>-fab :
        bridge "root"                    the root switch
        bridge "b<l>x<g>"                the switch inside member g of level l   (l < n-1)
        veth  "u<l>x<g>" <-> "d<l>x<g>"  uplink of member g of level l: "u" is enslaved to the
                                          member's bridge, "d" to the parent's  (l < n-1)
        tap   "p<k>"                      rank k's port on its parent bridge
    rank namespace    msc-<id>-r<k> :
        tap   "eth0"                      rank k's uplink (created in the fabric namespace as
                                          "t<k>" by the delay line, then moved here)

Every uplink is shaped in both directions to its level's bandwidth with a ``tbf`` qdisc on the
egress of each end; the delay line joining ``eth0`` and ``p<k>`` adds the path latency to every
IPv4 packet a rank sends (see :mod:`moesaic.cluster.delayline`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from moesaic.checks import check_int
from moesaic.cluster.spec import ClusterSpec

__all__ = [
    "ADDRESS_BLOCK",
    "NAMESPACE_RE",
    "NAME_PREFIX",
    "Link",
    "Topology",
    "build_topology",
    "tbf_args",
]

NAME_PREFIX = "msc-"
# Only names of exactly this form are ever removed by `cluster down`.
NAMESPACE_RE = re.compile(r"^msc-(?P<run_id>[0-9a-f]{6})-(?:fab|r\d+)$")
# RFC 2544 benchmarking block; never routed, only ever configured inside our namespaces.
ADDRESS_BLOCK = ipaddress.IPv4Network("198.18.0.0/15")
_FIRST_RANK_OFFSET = 256  # rank k gets 198.18.1.0 + k
MAX_RANKS = ADDRESS_BLOCK.num_addresses - 2 * _FIRST_RANK_OFFSET
ROOT_BRIDGE = "root"
RANK_IFNAME = "eth0"
_ETH_OVERHEAD_BYTES = 14
_TC_MAX_BYTES = 2**31 - 1  # tc refuses a larger tbf burst or limit


@dataclass(kw_only=True, slots=True, frozen=True)
class Link:
    """One shaped uplink: a member of ``level`` to its parent switch.

    Attributes:
        level: Level index of the member (0 = outermost).
        group: Global index of the member within its level.
        child_ns: Namespace holding the child-side device.
        child_dev: Child-side device (egress = upward traffic).
        child_bridge: Bridge the child-side device is enslaved to, or None for a rank's eth0.
        parent_dev: Parent-side device in the fabric namespace (egress = downward traffic).
        parent_bridge: Bridge the parent-side device is enslaved to.
        bandwidth_gbps: Shaped rate per direction, Gbit/s.
        kind: ``"veth"`` between bridges, ``"tap"`` for a rank's uplink through the delay line.
    """

    level: int
    group: int
    child_ns: str
    child_dev: str
    child_bridge: str | None
    parent_dev: str
    parent_bridge: str
    bandwidth_gbps: float
    kind: str


@dataclass(kw_only=True, slots=True, frozen=True)
class Topology:
    """Everything needed to build (and find again) one emulated cluster."""

    run_id: str
    spec: ClusterSpec
    fabric_ns: str
    rank_ns: tuple[str, ...]
    rank_addresses: tuple[str, ...]
    prefix_len: int
    bridges: tuple[str, ...]
    links: tuple[Link, ...]
    mtu_bytes: int

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.fabric_ns, *self.rank_ns)

    def rank_tap(self, rank: int) -> str:
        """Name of rank ``rank``'s tap while it is still in the fabric namespace."""
        return f"t{rank}"

    def rank_port(self, rank: int) -> str:
        return f"p{rank}"

    def delays_ms(self, rank: int) -> list[float]:
        """One-way latency from ``rank`` to every rank (0 to itself), milliseconds."""
        return [
            0.0 if dst == rank else self.spec.path(rank, dst).latency_ms
            for dst in range(self.spec.world_size)
        ]


def rank_address(rank: int) -> str:
    """IPv4 address of ``rank`` on the emulated network."""
    if not 0 <= rank < MAX_RANKS:
        raise ValueError(f"rank ({rank}) must be in [0, {MAX_RANKS}) to get an address")
    return str(ADDRESS_BLOCK.network_address + _FIRST_RANK_OFFSET + rank)


def first_rank_address_int() -> int:
    return int(ADDRESS_BLOCK.network_address) + _FIRST_RANK_OFFSET


def _bridge(level: int, group: int) -> str:
    return f"b{level}x{group}"


def _parent_bridge(spec: ClusterSpec, level: int, group: int) -> str:
    if level == 0:
        return ROOT_BRIDGE
    return _bridge(level - 1, group // spec.levels[level].size)


def build_topology(spec: ClusterSpec, *, run_id: str, mtu_bytes: int = 9000) -> Topology:
    """Plans the namespaces, bridges, links and addresses of an emulated ``spec``.

    Args:
        spec: The cluster to emulate.
        run_id: Six lowercase hex digits naming this run (``msc-<run_id>-...``).
        mtu_bytes: MTU of every emulated link (jumbo frames keep the delay line's packet rate,
            and so its CPU use, low: 500 Mbit/s is ~7k packets/s at 9000 bytes).

    Raises:
        ValueError: If ``run_id`` or ``mtu_bytes`` break their rules or the cluster is too big.
    """
    if not re.fullmatch(r"[0-9a-f]{6}", run_id):
        raise ValueError(f"run_id ({run_id!r}) must be 6 lowercase hex digits")
    check_int("mtu_bytes", mtu_bytes, 576, 65000)
    world = spec.world_size
    if world > MAX_RANKS:
        raise ValueError(
            f"world_size ({world}) must be at most {MAX_RANKS} to fit the address block"
        )
    prefix = f"{NAME_PREFIX}{run_id}"
    fabric_ns = f"{prefix}-fab"
    rank_ns = tuple(f"{prefix}-r{k}" for k in range(world))
    n = spec.num_levels
    bridges = [ROOT_BRIDGE]
    links: list[Link] = []
    for level in range(n - 1):
        for group in range(spec.num_groups(level)):
            bridges.append(_bridge(level, group))
            links.append(
                Link(
                    level=level,
                    group=group,
                    child_ns=fabric_ns,
                    child_dev=f"u{level}x{group}",
                    child_bridge=_bridge(level, group),
                    parent_dev=f"d{level}x{group}",
                    parent_bridge=_parent_bridge(spec, level, group),
                    bandwidth_gbps=spec.levels[level].bandwidth_gbps,
                    kind="veth",
                )
            )
    for rank in range(world):
        links.append(
            Link(
                level=n - 1,
                group=rank,
                child_ns=rank_ns[rank],
                child_dev=RANK_IFNAME,
                child_bridge=None,
                parent_dev=f"p{rank}",
                parent_bridge=_parent_bridge(spec, n - 1, rank),
                bandwidth_gbps=spec.levels[n - 1].bandwidth_gbps,
                kind="tap",
            )
        )
    return Topology(
        run_id=run_id,
        spec=spec,
        fabric_ns=fabric_ns,
        rank_ns=rank_ns,
        rank_addresses=tuple(rank_address(k) for k in range(world)),
        prefix_len=ADDRESS_BLOCK.prefixlen,
        bridges=tuple(bridges),
        links=tuple(links),
        mtu_bytes=mtu_bytes,
    )


def tbf_args(bandwidth_gbps: float, mtu_bytes: int) -> list[str]:
    """``tc qdisc ... tbf`` arguments shaping a link to ``bandwidth_gbps``.

    tbf (not netem's rate, which this kernel may lack and which is inaccurate at high rates) with:

    * ``burst`` = max(one frame, 1 ms at the rate): a bucket smaller than a frame would drop every
      frame, and 1 ms keeps tbf's timer from limiting the rate at multi-Gbit/s. The first burst
      of an idle link passes at line speed; bandwidth is measured as a difference of two
      transfer sizes, which cancels it.
    * ``limit`` = max(100 ms at the rate, 256 KiB, 4 bursts): a deep queue, so TCP rarely sees a
      drop (a timeout costs >= 200 ms and would wreck a short measurement).

    Both are capped at 2^31 - 1 bytes, the most ``tc`` accepts (reached above ~170 Gbit/s, far
    beyond what the emulator can move anyway).
    """
    rate_bytes_per_s = bandwidth_gbps * 1e9 / 8
    frame_bytes = mtu_bytes + _ETH_OVERHEAD_BYTES
    burst_bytes = min(_TC_MAX_BYTES, max(frame_bytes, int(rate_bytes_per_s * 1e-3)))
    limit_bytes = min(_TC_MAX_BYTES, max(int(rate_bytes_per_s * 0.1), 256 * 1024, 4 * burst_bytes))
    rate_bit = max(8, round(bandwidth_gbps * 1e9))
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst_bytes), "limit", str(limit_bytes)]
