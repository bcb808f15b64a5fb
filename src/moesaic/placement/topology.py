"""HybridEP multilevel expert domains: location renumbering (Eq. 13) and Algorithm 1.

A world of ``G = SF^0 x ... x SF^(L-1)`` ranks is described level by level, outermost first (the
same order as :class:`moesaic.cluster.spec.ClusterSpec`: ``SF^0`` datacenters, ``SF^1`` ranks per
datacenter, ...). At level ``l`` the ``SF^l`` workers are cut into domains of ``S_ED^l``
consecutive workers. Inside a domain experts move by all-gather ("AG"); between domains tokens
move by all-to-all ("A2A") to the worker at the same offset of the other domain.

Departure from Algorithm 1 (``literal=False``, the default): line 8 of the paper compares only
the coordinates *inner* to ``l`` (``Loc[l+1:]``). Taken literally, two ranks that differ at an
outer level and at an inner one are typed at the inner level: with 2 datacenters x 2 ranks and
``S_ED = (1, 2)``, ranks 0 = (0, 0) and 3 = (1, 1) get ``comm_type(0, 3, 1) == "AG"``, an
all-gather over the slow datacenter link booked as an intra-datacenter one, and rank 0 would hold
experts from outside its level-0 domain. The consistent rule compares every coordinate except
``l`` (``Loc[:l] + Loc[l+1:]``), so level-``l`` traffic only ever crosses level-``l`` links and a
rank's experts after the gathers are exactly those of its multilevel domain. On one level the two
rules are the same (Table VII is unchanged). ``literal=True`` gives the paper's text.

Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from moesaic.checks import check_positive_int, is_int

if TYPE_CHECKING:
    from moesaic.cluster.spec import ClusterSpec

__all__ = ["CommType", "Topology", "default_domain_sizes"]

CommType = Literal["AG", "A2A"]


@dataclass(kw_only=True, slots=True, frozen=True)
class Topology:
    """Multilevel expert domains of HybridEP (§IV-A).

    Attributes:
        scaling_factors: ``SF^l`` per level, outermost first: a worker of level ``l - 1`` holds
            ``SF^l`` workers of level ``l`` (``SF^0``: workers of the outermost level).
        domain_sizes: ``S_ED^l`` per level: workers of level ``l`` per expert domain; each divides
            its ``SF^l``. 1 everywhere is classic EP; ``SF^l`` everywhere is all-gather only.
        world_size: Optional ``G``; when given it must equal the product of ``scaling_factors``.
    """

    scaling_factors: tuple[int, ...]
    domain_sizes: tuple[int, ...]
    world_size: int | None = None

    def __post_init__(self) -> None:
        sf = _int_tuple("scaling_factors", self.scaling_factors)
        sd = _int_tuple("domain_sizes", self.domain_sizes)
        object.__setattr__(self, "scaling_factors", sf)
        object.__setattr__(self, "domain_sizes", sd)
        if len(sd) != len(sf):
            raise ValueError(
                f"domain_sizes ({list(sd)}) must have one entry per level of scaling_factors "
                f"({len(sf)} levels)"
            )
        for level, (f, s) in enumerate(zip(sf, sd)):
            if f % s:
                raise ValueError(
                    f"domain_sizes[{level}] ({s}) must divide scaling_factors[{level}] ({f})"
                )
        product = math.prod(sf)
        if self.world_size is None:
            object.__setattr__(self, "world_size", product)
        else:
            check_positive_int("world_size", self.world_size)
            if self.world_size != product:
                raise ValueError(
                    f"scaling_factors ({' x '.join(map(str, sf))} = {product}) must multiply to "
                    f"world_size ({self.world_size})"
                )

    @classmethod
    def from_cluster(cls, spec: ClusterSpec, domain_sizes: Sequence[int]) -> Topology:
        """The levels of a cluster description (``SF^l`` = ``levels[l].size``), outermost first."""
        return cls(
            scaling_factors=tuple(level.size for level in spec.levels),
            domain_sizes=tuple(domain_sizes),
            world_size=spec.world_size,
        )

    # ------------------------------------------------------------------------------ geometry
    @property
    def num_levels(self) -> int:
        return len(self.scaling_factors)

    @property
    def size(self) -> int:
        """``G``, the number of ranks."""
        return math.prod(self.scaling_factors)

    def locate(self, m: int) -> tuple[int, ...]:
        """Eq. 13: global rank ``m`` -> ``(x_0, ..., x_(L-1))``, outermost first."""
        self._check_rank("m", m)
        out = []
        for f in reversed(self.scaling_factors):
            m, x = divmod(m, f)
            out.append(x)
        return tuple(reversed(out))

    def rank_of(self, location: Sequence[int]) -> int:
        """Inverse of :meth:`locate`."""
        if len(location) != self.num_levels:
            raise ValueError(f"location ({list(location)}) must have {self.num_levels} entries")
        m = 0
        for level, (x, f) in enumerate(zip(location, self.scaling_factors)):
            if not is_int(x) or not 0 <= x < f:
                raise ValueError(f"location[{level}] ({x!r}) must be in [0, {f})")
            m = m * f + x
        return m

    def domain_of(self, m: int, level: int) -> tuple[int, int]:
        """``(ED, offset)`` of rank ``m`` at ``level``: ``W // S_ED^l`` and ``W mod S_ED^l``."""
        self._check_level(level)
        return divmod(self.locate(m)[level], self.domain_sizes[level])

    # ----------------------------------------------------------------------------- Algorithm 1
    def comm_type(self, m: int, n: int, level: int, *, literal: bool = False) -> CommType | None:
        """Algorithm 1: how ranks ``m`` and ``n`` talk at ``level`` ("AG", "A2A" or None).

        Args:
            m: Global rank.
            n: Global rank.
            level: Level index (0 = outermost).
            literal: True follows the paper's line 8 (only inner coordinates must agree); False
                (default) also requires the outer ones to agree, see the module docstring.
        """
        self._check_level(level)
        loc_m, loc_n = self.locate(m), self.locate(n)
        others_m = loc_m[level + 1 :] if literal else loc_m[:level] + loc_m[level + 1 :]
        others_n = loc_n[level + 1 :] if literal else loc_n[:level] + loc_n[level + 1 :]
        if others_m != others_n:
            return None
        ed_m, off_m = divmod(loc_m[level], self.domain_sizes[level])
        ed_n, off_n = divmod(loc_n[level], self.domain_sizes[level])
        if ed_m == ed_n and off_m != off_n:
            return "AG"
        if ed_m != ed_n and off_m == off_n:
            return "A2A"
        return None

    def peers(self, m: int, level: int, kind: CommType, *, literal: bool = False) -> list[int]:
        """Ranks ``n`` with ``comm_type(m, n, level) == kind``, ascending."""
        if kind not in ("AG", "A2A"):
            raise ValueError(f"kind ({kind!r}) must be 'AG' or 'A2A'")
        if literal:
            candidates: Sequence[int] = range(self.size)
        else:  # the consistent rule only pairs ranks that differ in coordinate ``level`` alone
            loc = list(self.locate(m))
            candidates = []
            for w in range(self.scaling_factors[level]):
                loc[level] = w
                candidates.append(self.rank_of(loc))
        return [
            n for n in candidates if n != m and self.comm_type(m, n, level, literal=literal) == kind
        ]

    def ag_peers(self, m: int, level: int) -> list[int]:
        """Ranks rank ``m`` all-gathers experts with at ``level`` (its domain, other offsets)."""
        return self.peers(m, level, "AG")

    def a2a_peers(self, m: int, level: int) -> list[int]:
        """Ranks rank ``m`` exchanges tokens with at ``level`` (same offset, other domains)."""
        return self.peers(m, level, "A2A")

    def domain_ranks(self, m: int) -> list[int]:
        """Ranks whose experts rank ``m`` holds after the gathers of every level, ascending.

        Those in the same domain as ``m`` at every level (``m`` included): ``prod(S_ED^l)`` ranks.
        """
        eds = [self.domain_of(m, level)[0] for level in range(self.num_levels)]
        return [
            n
            for n in range(self.size)
            if all(self.domain_of(n, level)[0] == eds[level] for level in range(self.num_levels))
        ]

    def counts(self, *, literal: bool = False) -> dict[str, list[int]]:
        """Ordered-pair communication counts per type and level (Table VII's form).

        Returns:
            ``{"A2A": [count at level 0, ...], "AG": [...]}``: the number of ordered rank pairs
            ``(m, n)``, ``m != n``, that :meth:`comm_type` gives that type at each level. Table
            VII (one level, ``G`` ranks, domain size ``S``) reads ``A2A = G (G/S - 1)`` and
            ``AG = G (S - 1)``.
        """
        out: dict[str, list[int]] = {"A2A": [0] * self.num_levels, "AG": [0] * self.num_levels}
        for kind in ("A2A", "AG"):
            for level in range(self.num_levels):
                out[kind][level] = sum(
                    len(self.peers(m, level, kind, literal=literal)) for m in range(self.size)
                )
        return out

    def _check_rank(self, field: str, m: int) -> None:
        if not is_int(m) or not 0 <= m < self.size:
            raise ValueError(f"{field} ({m!r}) must be a rank in [0, {self.size})")

    def _check_level(self, level: int) -> None:
        if not is_int(level) or not 0 <= level < self.num_levels:
            raise ValueError(f"level ({level!r}) must be an index in [0, {self.num_levels})")


def default_domain_sizes(scaling_factors: Sequence[int]) -> tuple[int, ...]:
    """The expert domains when none are given: the whole innermost level (the ranks of one
    node, or of the group when it is one level), 1 at every outer level. A domain that
    spans an outer level would all-gather every expert over its slow links and hold the
    experts of every node on every rank; tokens cross those links instead."""
    sizes = _int_tuple("scaling_factors", scaling_factors)
    return (1,) * (len(sizes) - 1) + (sizes[-1],)


def _int_tuple(field: str, values: Sequence[int]) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{field} ({values!r}) must be a non-empty list of ints")
    for i, v in enumerate(values):
        check_positive_int(f"{field}[{i}]", v)
    return tuple(values)
