"""Cluster description: a tree of levels, each with a size, a link bandwidth and a latency.

A cluster is described from the outermost level to the innermost one. Each level says how many
members every member of the level above holds (``size``), how fast the link is that connects each
member to its parent switch (``bandwidth_gbps``), and the one-way latency between two ranks that
this level separates (``latency_ms``)::

    name = "2dc_2node"
    world_size = 4                       # optional; must equal the product of the sizes

    [[levels]]                           # outermost: 2 datacenters joined by a WAN link
    name = "datacenter"
    size = 2
    bandwidth_gbps = 1.0
    latency_ms = 5.0

    [[levels]]                           # innermost: 2 single-rank nodes per datacenter
    name = "node"
    size = 2
    bandwidth_gbps = 10.0
    latency_ms = 0.1

Ranks are numbered in mixed radix, outermost level most significant: with the example above
ranks 0, 1 are in datacenter 0 and ranks 2, 3 in datacenter 1.

Semantics shared by the emulator, the cost model and the simulator:

* The **separating level** of two ranks is the outermost level at which their coordinates differ.
* Their traffic crosses the uplinks of every level from the separating level inwards (up on the
  sender's side, down on the receiver's side), so the **path bandwidth** is the minimum
  ``bandwidth_gbps`` over those levels; with inner links at least as fast as outer ones (the usual
  case) it is the separating level's own bandwidth. Uplinks are shared: all ranks inside a group
  share that group's uplink in each direction.
* The **path latency** (one way) is the separating level's ``latency_ms``, end to end; the
  round trip is twice that.

This module needs only the standard library, so the cost model and the simulator can use it
without the emulator (which needs root) or torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesaic.checks import check_int, check_number, is_int, read_toml

__all__ = [
    "MAX_BANDWIDTH_GBPS",
    "MAX_LATENCY_MS",
    "MAX_WORLD_SIZE",
    "MIN_BANDWIDTH_GBPS",
    "ClusterSpec",
    "Level",
    "PathInfo",
]

# Sane limits, wide enough for any real cluster and narrow enough that a typo (10^12 ms) is caught
# here rather than as a traceback in the emulator or a meaningless simulation:
MIN_BANDWIDTH_GBPS = 1e-6  # 1 kbit/s: below that nothing useful crosses a link
MAX_BANDWIDTH_GBPS = 1e5  # 100 Tbit/s per direction: above NVLink 5 (7.2 Tbit/s) with headroom
MAX_LATENCY_MS = 1e4  # 10 s one way: above any WAN or satellite path (~300-600 ms)
MAX_WORLD_SIZE = 1 << 20  # ranks; the cost model holds P x P traffic matrices

_LEVEL_FIELDS = ("name", "size", "bandwidth_gbps", "latency_ms")
_SPEC_FIELDS = ("name", "world_size", "levels")


@dataclass(kw_only=True, slots=True, frozen=True)
class Level:
    """One level of the cluster tree.

    Attributes:
        name: Human-readable name, unique within the cluster (e.g. ``"datacenter"``).
        size: Number of members of this level inside each member of the level above (>= 1).
        bandwidth_gbps: Rate of the link joining each member to its parent switch, in Gbit/s
            (10^9 bit/s), per direction.
        latency_ms: One-way latency, in milliseconds, between two ranks separated at this level.
    """

    name: str
    size: int
    bandwidth_gbps: float
    latency_ms: float

    def __post_init__(self) -> None:
        _check_level(self.name, self.size, self.bandwidth_gbps, self.latency_ms, where="level")


@dataclass(kw_only=True, slots=True, frozen=True)
class PathInfo:
    """What a message between two ranks sees.

    Attributes:
        level: Index of the separating level (0 = outermost).
        level_name: Name of the separating level.
        bandwidth_gbps: Bottleneck bandwidth of the path (min over the crossed levels), Gbit/s.
        latency_ms: One-way latency of the path, milliseconds.
    """

    level: int
    level_name: str
    bandwidth_gbps: float
    latency_ms: float


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterSpec:
    """A cluster as a tree of levels, outermost first.

    Attributes:
        levels: The levels, outermost first (at least one).
        name: Name of the cluster, used in reports.
    """

    levels: tuple[Level, ...]
    name: str = "cluster"

    def __post_init__(self) -> None:
        if not isinstance(self.levels, tuple):
            object.__setattr__(self, "levels", tuple(self.levels))
        if not self.levels:
            raise ValueError("levels must list at least one level")
        for i, level in enumerate(self.levels):
            if not isinstance(level, Level):
                raise ValueError(f"levels[{i}] must be a Level, got {type(level).__name__}")
        names = [level.name for level in self.levels]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ValueError(f"levels[{i}].name ({name!r}) must be unique across levels")
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name ({self.name!r}) must be a non-empty string")
        world = math.prod(level.size for level in self.levels)
        if world > MAX_WORLD_SIZE:
            sizes = " x ".join(str(level.size) for level in self.levels)
            raise ValueError(
                f"world_size ({world}) must be <= {MAX_WORLD_SIZE}: the product of "
                f"levels[*].size ({sizes}) is too big to describe or simulate"
            )

    # ----------------------------------------------------------------------------- construction
    @classmethod
    def from_toml(cls, path: str | Path) -> ClusterSpec:
        """Reads a cluster description from a TOML file.

        Raises:
            FileNotFoundError: If ``path`` does not exist.
            ValueError: If the file is not valid TOML or breaks a rule (the message names the
                field and the rule).
        """
        return cls.from_dict(read_toml(path, "cluster file"), default_name=Path(path).stem)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, default_name: str = "cluster") -> ClusterSpec:
        """Builds a spec from a parsed mapping (the TOML layout), validating every field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"cluster description must be a table, got {type(data).__name__}")
        unknown = sorted(set(data) - set(_SPEC_FIELDS))
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; allowed fields are {list(_SPEC_FIELDS)}")
        if "levels" not in data:
            raise ValueError("missing field 'levels' (an array of [[levels]] tables)")
        raw_levels = data["levels"]
        if not isinstance(raw_levels, list) or not raw_levels:
            raise ValueError("levels must be a non-empty array of [[levels]] tables")
        levels = tuple(_level_from_dict(i, raw) for i, raw in enumerate(raw_levels))
        spec = cls(levels=levels, name=data.get("name", default_name))
        if "world_size" in data:
            stated = check_int("world_size", data["world_size"], 1)
            if stated != spec.world_size:
                product = " x ".join(str(level.size) for level in levels)
                raise ValueError(
                    f"world_size ({stated}) must equal the product of levels[*].size "
                    f"({product} = {spec.world_size})"
                )
        return spec

    def to_dict(self) -> dict[str, Any]:
        """The TOML layout of this spec (round-trips through :meth:`from_dict`)."""
        return {
            "name": self.name,
            "world_size": self.world_size,
            "levels": [{f: getattr(level, f) for f in _LEVEL_FIELDS} for level in self.levels],
        }

    # ------------------------------------------------------------------------------- geometry
    @property
    def world_size(self) -> int:
        """Number of ranks: the product of the level sizes."""
        return math.prod(level.size for level in self.levels)

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    def num_groups(self, level: int) -> int:
        """How many members ``level`` has in the whole cluster (datacenters, nodes, ...)."""
        self._check_level_index(level)
        return math.prod(lv.size for lv in self.levels[: level + 1])

    def ranks_per_group(self, level: int) -> int:
        """How many ranks each member of ``level`` holds."""
        self._check_level_index(level)
        return math.prod(lv.size for lv in self.levels[level + 1 :])

    def group_of(self, rank: int, level: int) -> int:
        """Global index of the member of ``level`` that holds ``rank``."""
        self._check_rank(rank, "rank")
        return rank // self.ranks_per_group(level)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank``, outermost first (mixed radix of the level sizes)."""
        self._check_rank(rank, "rank")
        out = []
        for level in reversed(self.levels):
            rank, digit = divmod(rank, level.size)
            out.append(digit)
        return tuple(reversed(out))

    def separating_level(self, rank_a: int, rank_b: int) -> int:
        """Index of the outermost level at which two distinct ranks differ."""
        self._check_rank(rank_a, "rank_a")
        self._check_rank(rank_b, "rank_b")
        if rank_a == rank_b:
            raise ValueError(f"rank_a and rank_b ({rank_a}) must differ to have a separating level")
        for level, (a, b) in enumerate(zip(self.coords(rank_a), self.coords(rank_b))):
            if a != b:
                return level
        raise AssertionError("unreachable: distinct ranks differ in some coordinate")

    def path(self, rank_a: int, rank_b: int) -> PathInfo:
        """Separating level, bottleneck bandwidth and one-way latency between two ranks."""
        level = self.separating_level(rank_a, rank_b)
        return PathInfo(
            level=level,
            level_name=self.levels[level].name,
            bandwidth_gbps=min(lv.bandwidth_gbps for lv in self.levels[level:]),
            latency_ms=self.levels[level].latency_ms,
        )

    def representative_pairs(self) -> dict[int, tuple[int, int]]:
        """For each level that separates some ranks, one pair of ranks it separates.

        The pair is (0, first rank separated from 0 at that level); a level of size 1 separates
        nobody and is left out.
        """
        pairs: dict[int, tuple[int, int]] = {}
        for level, lv in enumerate(self.levels):
            if lv.size > 1:
                pairs[level] = (0, self.ranks_per_group(level))
        return pairs

    def _check_level_index(self, level: int) -> None:
        if not is_int(level) or not 0 <= level < len(self.levels):
            raise ValueError(f"level ({level!r}) must be an index in [0, {len(self.levels)})")

    def _check_rank(self, rank: int, field: str) -> None:
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"{field} ({rank!r}) must be a rank in [0, {self.world_size})")


def _level_from_dict(index: int, raw: Any) -> Level:
    where = f"levels[{index}]"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a table, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_LEVEL_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed are {list(_LEVEL_FIELDS)}")
    missing = [f for f in _LEVEL_FIELDS if f not in raw]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    _check_level(raw["name"], raw["size"], raw["bandwidth_gbps"], raw["latency_ms"], where=where)
    return Level(
        name=raw["name"],
        size=raw["size"],
        bandwidth_gbps=float(raw["bandwidth_gbps"]),
        latency_ms=float(raw["latency_ms"]),
    )


def _check_level(name: Any, size: Any, bandwidth_gbps: Any, latency_ms: Any, *, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name ({name!r}) must be a non-empty string")
    check_int(f"{where}.size", size, 1, MAX_WORLD_SIZE)
    check_number(f"{where}.bandwidth_gbps", bandwidth_gbps, MIN_BANDWIDTH_GBPS, MAX_BANDWIDTH_GBPS)
    check_number(f"{where}.latency_ms", latency_ms, 0.0, MAX_LATENCY_MS)
