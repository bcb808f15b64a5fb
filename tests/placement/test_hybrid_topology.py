"""moesaic.placement.topology: Eq. 13 renumbering, Algorithm 1, Table VII counts, validation."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from moesaic.placement.topology import Topology

# Table VII of the paper: (EP size, S_ED) -> (A2A, AG) ordered-pair counts.
TABLE_VII = {
    8: {1: (56, 0), 2: (24, 8), 4: (8, 24), 8: (0, 56)},
    16: {1: (240, 0), 2: (112, 16), 4: (48, 48), 8: (16, 112), 16: (0, 240)},
    32: {1: (992, 0), 2: (480, 32), 4: (224, 96), 8: (96, 224), 16: (32, 480), 32: (0, 992)},
}


@pytest.mark.parametrize(
    ("ep", "s"), [(ep, s) for ep, row in TABLE_VII.items() for s in row], ids=str
)
def test_table_vii_counts(ep: int, s: int) -> None:
    counts = Topology(scaling_factors=[ep], domain_sizes=[s]).counts()
    assert (counts["A2A"][0], counts["AG"][0]) == TABLE_VII[ep][s]


@pytest.mark.parametrize(
    ("ep", "s"),
    [
        (2, 1),  # smallest world, classic EP
        (2, 2),  # smallest world, all-gather only
        (6, 3),  # non-power-of-two world
        (12, 4),  # three domains
        (9, 3),  # odd world
        (7, 7),  # prime world, one domain
    ],
)
def test_counts_other_sizes_follow_the_table_rule(ep: int, s: int) -> None:
    counts = Topology(scaling_factors=[ep], domain_sizes=[s]).counts()
    assert counts == {"A2A": [ep * (ep // s - 1)], "AG": [ep * (s - 1)]}


@pytest.mark.parametrize(
    ("sf", "sd"),
    [
        ((4, 4), (2, 4)),  # the paper's Fig. 8(b) example
        ((2, 2), (1, 2)),
        ((3, 2, 2), (3, 1, 2)),  # three levels, odd outer size
        ((2, 3), (2, 3)),
    ],
)
def test_multilevel_counts_and_peers_are_per_level(
    sf: tuple[int, ...], sd: tuple[int, ...]
) -> None:
    topo = Topology(scaling_factors=sf, domain_sizes=sd)
    G = topo.size
    counts = topo.counts()
    for level, (f, s) in enumerate(zip(sf, sd)):
        # every rank has S-1 AG and F/S-1 A2A peers at each level, all differing in that
        # coordinate only
        assert counts["AG"][level] == G * (s - 1)
        assert counts["A2A"][level] == G * (f // s - 1)
        for m in range(G):
            for n in topo.ag_peers(m, level) + topo.a2a_peers(m, level):
                lm, ln = topo.locate(m), topo.locate(n)
                assert [i for i in range(len(sf)) if lm[i] != ln[i]] == [level]
            assert topo.ag_peers(m, level) == topo.peers(m, level, "AG")
    for m in range(G):
        dom = topo.domain_ranks(m)
        assert len(dom) == math.prod(sd) and m in dom


def test_literal_algorithm_1_books_a_cross_datacenter_gather_at_the_inner_level() -> None:
    # The case that forced the departure (module docstring): 2 DCs x 2 ranks, S_ED = (1, 2).
    topo = Topology(scaling_factors=[2, 2], domain_sizes=[1, 2])
    assert topo.locate(0) == (0, 0) and topo.locate(3) == (1, 1)
    assert topo.comm_type(0, 3, 1, literal=True) == "AG"
    assert topo.comm_type(0, 3, 1) is None
    assert topo.comm_type(0, 1, 1) == topo.comm_type(0, 1, 1, literal=True) == "AG"
    assert topo.comm_type(0, 2, 0) == topo.comm_type(0, 2, 0, literal=True) == "A2A"
    assert 3 in topo.peers(0, 1, "AG", literal=True)
    assert topo.ag_peers(0, 1) == [1]
    # Fig. 8(b)'s 4 DCs x 4 GPUs, S_ED = (2, 4): taken literally every GPU gathers at level 1
    # from the 12 GPUs with another level-1 index in *any* DC (16 x 12 = 192), not only its 3
    # DC-mates (48)
    fig8 = Topology(scaling_factors=[4, 4], domain_sizes=[2, 4])
    assert fig8.counts(literal=True)["AG"] == [16, 192]
    assert fig8.counts() == {"A2A": [16, 0], "AG": [16, 48]}


def test_one_level_literal_equals_consistent() -> None:
    topo = Topology(scaling_factors=[12], domain_sizes=[3])
    assert topo.counts() == topo.counts(literal=True)


def test_algorithm_1_rules_on_one_level() -> None:
    topo = Topology(scaling_factors=[8], domain_sizes=[2])
    assert topo.comm_type(0, 1, 0) == "AG"  # same domain, other offset
    assert topo.comm_type(0, 2, 0) == "A2A"  # other domain, same offset
    assert topo.comm_type(0, 3, 0) is None  # other domain, other offset: reached via 2
    assert topo.comm_type(5, 5, 0) is None
    assert topo.a2a_peers(1, 0) == [3, 5, 7]
    assert topo.domain_of(5, 0) == (2, 1)


@pytest.mark.parametrize("sf", [(8,), (2, 4), (3, 2, 2), (2, 1, 3)])
def test_renumbering_round_trip(sf: tuple[int, ...]) -> None:
    topo = Topology(scaling_factors=sf, domain_sizes=[1] * len(sf))
    locations = [topo.locate(m) for m in range(topo.size)]
    # Eq. 13 is mixed radix, outermost most significant: lexicographic order of locations
    assert locations == list(itertools.product(*(range(f) for f in sf)))
    assert [topo.rank_of(loc) for loc in locations] == list(range(topo.size))


def test_eq13_example() -> None:
    topo = Topology(scaling_factors=[4, 4], domain_sizes=[2, 4])
    assert topo.locate(6) == (1, 2)  # x_0 = 6 // 4 mod 4, x_1 = 6 mod 4
    assert topo.domain_of(6, 0) == (0, 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"scaling_factors": [8], "domain_sizes": [3]}, "domain_sizes[0]"),
        ({"scaling_factors": [2, 4], "domain_sizes": [2, 3]}, "domain_sizes[1]"),
        ({"scaling_factors": [2, 4], "domain_sizes": [2], "world_size": 8}, "domain_sizes"),
        ({"scaling_factors": [2, 4], "domain_sizes": [1, 1], "world_size": 16}, "scaling_factors"),
        ({"scaling_factors": [0], "domain_sizes": [1]}, "scaling_factors[0]"),
        ({"scaling_factors": [4], "domain_sizes": [-2]}, "domain_sizes[0]"),
        ({"scaling_factors": [], "domain_sizes": []}, "scaling_factors"),
        ({"scaling_factors": [2.0], "domain_sizes": [1]}, "scaling_factors[0]"),
    ],
)
def test_invalid_descriptions_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(field) + " "):
        Topology(**kwargs)


def test_bad_ranks_and_levels() -> None:
    topo = Topology(scaling_factors=[2, 2], domain_sizes=[1, 1])
    with pytest.raises(ValueError, match="m"):
        topo.locate(4)
    with pytest.raises(ValueError, match="level"):
        topo.comm_type(0, 1, 2)
    with pytest.raises(ValueError, match="kind"):
        topo.peers(0, 0, "RS")  # type: ignore[arg-type]


def test_from_cluster_takes_the_levels_outermost_first() -> None:
    from moesaic.cluster.spec import ClusterSpec, Level

    spec = ClusterSpec(
        levels=(
            Level(name="dc", size=3, bandwidth_gbps=0.1, latency_ms=5.0),
            Level(name="node", size=2, bandwidth_gbps=10.0, latency_ms=0.1),
        )
    )
    topo = Topology.from_cluster(spec, [3, 1])
    assert topo.scaling_factors == (3, 2) and topo.size == spec.world_size == 6
    assert [topo.locate(m) for m in range(6)] == [spec.coords(m) for m in range(6)]
    with pytest.raises(ValueError, match=r"^domain_sizes\[0\] "):
        Topology.from_cluster(spec, [2, 1])
