"""moesaic.sim.hybrid_costmodel: Eqs. 1-12, closed form vs exhaustive search, multilevel plan."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from moesaic.cluster.spec import ClusterSpec, Level
from moesaic.config import MoEConfig
from moesaic.placement.compress import compressed_nbytes
from moesaic.sim.hybrid_costmodel import (
    StreamInputs,
    evaluate_domains,
    gemm_latency_s,
    latency,
    measure_gemm_flops,
    optimal_p,
    plan_domains,
    search_p,
    stream_inputs,
)

GBPS = 1e9 / 8  # bytes/s in 1 Gbit/s
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"


def _draw(rng: random.Random) -> tuple[StreamInputs, int, float]:
    G = rng.choice([2, 3, 4, 5, 8, 16, 32, rng.randint(2, 64)])
    inputs = StreamInputs(
        data_bytes=10 ** rng.uniform(3, 9),
        expert_bytes=10 ** rng.uniform(3, 9),
        pre_expert_s=rng.choice([0.0, 10 ** rng.uniform(-6, 1)]),
        experts_per_rank=rng.randint(1, 8),
        expert_s=10 ** rng.uniform(-5, -1),
    )
    bw = 10 ** rng.uniform(-2, 2)
    if rng.random() < 0.3:  # near 2D = G P_E with the kink inside (0, 1): where 2.1 lives
        inputs = StreamInputs(
            data_bytes=inputs.expert_bytes * G / 2 * rng.uniform(0.9, 1.1),
            expert_bytes=inputs.expert_bytes,
            pre_expert_s=rng.random() * inputs.expert_bytes * (G - 1) / (bw * GBPS),
        )
    return inputs, G, bw


def test_closed_form_equals_exhaustive_search_on_random_inputs() -> None:
    rng = random.Random(11)
    seen_cases = set()
    for _ in range(400):
        inputs, G, bw = _draw(rng)
        closed = optimal_p(inputs, num_ranks=G, bandwidth_gbps=bw)
        found = search_p(inputs, num_ranks=G, bandwidth_gbps=bw)
        assert closed.p == found.p, (inputs, G, bw)
        assert closed.latency_s == pytest.approx(found.latency_s, rel=1e-12)
        assert closed.case == found.case
        seen_cases.add(found.case)
    assert seen_cases == {"1", "2.1", "2.2"}  # the draws reach every case


def test_eq10_is_eq8() -> None:
    rng = random.Random(3)
    for _ in range(50):
        inputs, G, bw = _draw(rng)
        parts = latency(inputs, rng.randrange(G) / (G - 1), num_ranks=G, bandwidth_gbps=bw)
        assert parts.final_s == pytest.approx(
            max(inputs.pre_expert_s, parts.ag_s) + 2 * parts.a2a_s
        )


def test_eqs_3_4_by_hand() -> None:
    inputs = StreamInputs(data_bytes=8e6, expert_bytes=1e6, pre_expert_s=0.01)
    ep = latency(inputs, 1.0, num_ranks=8, bandwidth_gbps=1.0)
    assert ep.a2a_s == pytest.approx(7e6 / GBPS) and ep.ag_s == 0.0  # D (G-1)/G / B
    assert ep.final_s == pytest.approx(0.01 + 2 * 7e6 / GBPS)
    ag = latency(inputs, 0.0, num_ranks=8, bandwidth_gbps=1.0)
    assert ag.a2a_s == 0.0 and ag.ag_s == pytest.approx(7e6 / GBPS)  # P_E (G-1) / B


@pytest.mark.parametrize(
    ("data_bytes", "pre_expert_s", "p", "case"),
    [
        # 2D >= G P_E and no compute to hide the gather under: AG only
        (3e6, 0.0, 0.0, "2.2"),
        # the kink 1 - B Lat_PE / (P_E (G-1)) = 0.5 sits on the grid: case 1 at the kink
        (1e6, 2e6 / GBPS, 0.5, "1"),
        # kink at 0.74, case-2 slope nearly flat: the grid point below wins (case 2.1)
        (2.45e6, 0.26 * 4e6 / GBPS, 0.5, "2.1"),
        # same kink, steep case-2 slope: the grid point above wins (case 1)
        (1e5, 0.26 * 4e6 / GBPS, 0.75, "1"),
        # compute hides every gather: p = 0 in case 1
        (1e6, 1.0, 0.0, "1"),
    ],
)
def test_cases_by_hand(data_bytes: float, pre_expert_s: float, p: float, case: str) -> None:
    inputs = StreamInputs(data_bytes=data_bytes, expert_bytes=1e6, pre_expert_s=pre_expert_s)
    for solve in (optimal_p, search_p):
        got = solve(inputs, num_ranks=5, bandwidth_gbps=1.0)
        assert (got.p, got.case) == (p, case)


def test_exact_tie_goes_to_the_smaller_p() -> None:
    # 2D == G P_E: every p below the kink costs the same; both pick p = 0
    inputs = StreamInputs(data_bytes=2e6, expert_bytes=1e6, pre_expert_s=0.0)
    assert optimal_p(inputs, num_ranks=4, bandwidth_gbps=1.0).p == 0.0
    assert search_p(inputs, num_ranks=4, bandwidth_gbps=1.0).p == 0.0


def _spec(*levels: tuple[int, float, float]) -> ClusterSpec:
    return ClusterSpec(
        levels=tuple(
            Level(name=f"l{i}", size=s, bandwidth_gbps=b, latency_ms=t)
            for i, (s, b, t) in enumerate(levels)
        )
    )


@pytest.mark.parametrize("G", [4, 6, 8])
def test_one_level_plan_is_the_paper_formula(G: int) -> None:
    spec = _spec((G, 0.5, 0.0))
    inputs = StreamInputs(data_bytes=1e7, expert_bytes=2e6, pre_expert_s=0.01)
    for s in [d for d in range(1, G + 1) if G % d == 0]:
        cand = evaluate_domains(spec, inputs, [s])
        p = (G - s) / (G - 1)
        assert cand.p == (p,)
        expected = latency(inputs, p, num_ranks=G, bandwidth_gbps=0.5).final_s
        assert cand.final_s == pytest.approx(expected, rel=1e-12)


def test_two_levels_by_hand() -> None:
    # 2 DCs (100 Mbit/s, 5 ms) x 2 ranks (10 Gbit/s, 0.1 ms); each DC uplink carries both ranks
    spec = _spec((2, 0.1, 5.0), (2, 10.0, 0.1))
    inputs = StreamInputs(data_bytes=1e7, expert_bytes=2e6, pre_expert_s=0.01)
    ep = evaluate_domains(spec, inputs, [1, 1])
    # level 0: each rank sends D/2 across, two ranks share the DC uplink
    assert ep.a2a_s[0] == pytest.approx(2 * 5e6 * 8 / 0.1e9 + 5e-3)
    assert ep.a2a_s[1] == pytest.approx(5e6 * 8 / 10e9 + 1e-4)
    assert ep.final_s == pytest.approx(0.01 + 2 * sum(ep.a2a_s))
    both = evaluate_domains(spec, inputs, [2, 2])
    # gathers outermost first: P_E over the WAN, then the 2-expert bundle inside the DC
    assert both.ag_s[0] == pytest.approx(2 * 2e6 * 8 / 0.1e9 + 5e-3)
    assert both.ag_s[1] == pytest.approx(2 * 2e6 * 8 / 10e9 + 1e-4)
    assert both.a2a_s == (0.0, 0.0) and both.p == (0.0, 0.0)
    plan = plan_domains(spec, inputs)
    assert len(plan.candidates) == 4 and plan.classic.domain_sizes == (1, 1)
    assert plan.chosen.final_s == min(c.final_s for c in plan.candidates)
    assert plan.chosen.domain_sizes == (2, 2)
    assert "[2, 2]" in plan.reason and "classic EP" in plan.reason


def test_plan_reads_the_cluster_toml_and_prefers_classic_ep_for_small_batches() -> None:
    spec = ClusterSpec.from_toml(EXAMPLES / "2dc_2node.toml")
    config = MoEConfig(hidden_size=256, ffn_hidden_size=1024, num_experts=8, top_k=2)
    common = {"ep_size": spec.world_size, "flops_per_s": 1e11}
    tiny = stream_inputs(config, tokens_per_rank=1, **common)
    assert plan_domains(spec, tiny).chosen.domain_sizes == (1,) * spec.num_levels
    huge = stream_inputs(config, tokens_per_rank=1 << 16, **common)
    chosen = plan_domains(spec, huge).chosen
    assert chosen.domain_sizes != (1,) * spec.num_levels
    assert chosen.final_s < plan_domains(spec, huge).classic.final_s


def test_stream_inputs_from_config() -> None:
    config = MoEConfig(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2)
    got = stream_inputs(
        config,
        tokens_per_rank=32,
        ep_size=4,
        flops_per_s=1e9,
        act_bytes=4,
        param_bytes=2,
        pre_expert_flops=5e6,
    )
    assert got.experts_per_rank == 2
    assert got.data_bytes == 32 * 2 * 64 * 4  # T K H bytes
    assert got.expert_bytes == 2 * 3 * 64 * 128 * 2  # n x (w1, w3, w2) x bytes
    rows = 4 * 32 * 2 / 8  # tokens each expert gets under uniform routing
    assert got.expert_s == pytest.approx(3 * gemm_latency_s(int(rows), 64, 128, 1e9))
    assert got.pre_expert_s == pytest.approx(5e-3)
    squeezed = stream_inputs(
        config, tokens_per_rank=32, ep_size=4, flops_per_s=1e9, compression_ratio=50.0
    )
    assert squeezed.expert_bytes == 2 * 3 * compressed_nbytes(64 * 128, 50.0, 2)
    # CR 50 keeps 1/50 of the entries at 2 + 4 bytes each: 50 x 2/6 = 16.7x fewer bytes
    assert got.expert_bytes / squeezed.expert_bytes == pytest.approx(50 * 2 / 6, rel=0.01)
    # the default pre-expert estimate: one attention block + the router
    assert squeezed.pre_expert_s == pytest.approx(
        (8 * 32 * 64**2 + 4 * 32 * 32 * 64 + 2 * 32 * 64 * 8) / 1e9
    )


def test_gemm_latency_eq1() -> None:
    assert gemm_latency_s(10, 20, 30, 1e6) == pytest.approx(2 * 6000 / 1e6)
    assert math.isclose(gemm_latency_s(0, 20, 30, 1e6), 0.0)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda i: optimal_p(i, num_ranks=4, bandwidth_gbps=0.0), "bandwidth_gbps"),
        (lambda i: search_p(i, num_ranks=4, bandwidth_gbps=-1.0), "bandwidth_gbps"),
        (lambda i: optimal_p(i, num_ranks=1, bandwidth_gbps=1.0), "num_ranks"),
        (lambda i: latency(i, 1.5, num_ranks=4, bandwidth_gbps=1.0), "p"),
        (lambda i: evaluate_domains(_spec((4, 1.0, 0.0)), i, [3]), "domain_sizes[0]"),
        (lambda i: evaluate_domains(_spec((4, 1.0, 0.0)), i, [2, 1]), "domain_sizes"),
    ],
)
def test_invalid_arguments_name_the_field(call, field: str) -> None:
    inputs = StreamInputs(data_bytes=1e6, expert_bytes=1e6, pre_expert_s=0.0)
    with pytest.raises(ValueError, match=rf"^{field.replace('[', '.').replace(']', '.')} "):
        call(inputs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"data_bytes": 0.0}, "data_bytes"),
        ({"expert_bytes": -1.0}, "expert_bytes"),
        ({"pre_expert_s": -1.0}, "pre_expert_s"),
        ({"experts_per_rank": 0}, "experts_per_rank"),
    ],
)
def test_invalid_inputs_name_the_field(kwargs: dict, field: str) -> None:
    base = {"data_bytes": 1e6, "expert_bytes": 1e6, "pre_expert_s": 0.0}
    with pytest.raises(ValueError, match=f"^{field} "):
        StreamInputs(**{**base, **kwargs})


@pytest.mark.parametrize("bandwidth", [0.0, -1.0])
def test_cluster_bandwidth_must_be_positive(bandwidth: float) -> None:
    raw = {"levels": [{"name": "dc", "size": 2, "bandwidth_gbps": bandwidth, "latency_ms": 1.0}]}
    with pytest.raises(ValueError, match=r"^levels\[0\]\.bandwidth_gbps "):
        ClusterSpec.from_dict(raw)


def test_stream_inputs_rejects_an_ep_size_that_does_not_split_the_experts() -> None:
    config = MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=6, top_k=2)
    with pytest.raises(ValueError, match="num_experts"):
        stream_inputs(config, tokens_per_rank=4, ep_size=4, flops_per_s=1e9)


def test_measure_gemm_flops_is_a_rate() -> None:
    # a 64 x 64 matmul, twice: microseconds of CPU (the machine is shared)
    rate = measure_gemm_flops(64, repeats=1)
    assert math.isfinite(rate) and rate > 1e6
