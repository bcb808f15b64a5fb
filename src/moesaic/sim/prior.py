"""The routing prior: the expert loads a job's first steps see when nothing of its routing is
known (no data, no ``--loads``, no measured routing in the profile, no ``measured_loads`` or
``routing_skew`` in the model).

**What it is fitted on.** ``benchmarks/sim_routing_prior.py`` builds fresh MoEGPTs (2 blocks,
both MoE) over a grid of the routed experts E (4-64), top-k K (1, 2, 4), tokens of one step T
(512-8192, the world's) and width H (64-256), five seeds each, runs each on T tokens of the
default training corpus and records every MoE layer's loads
(``benchmarks/results/sim_routing_prior.json``). A fresh router is far from uniform: tokens of
one byte value share an embedding, so the corpus's frequent bytes go to the same experts.
The router's init std was a factor of the grid too (0.02 and 0.1): a router's top-k is
invariant to the scale of its weights, and the two measured alike, so the rule has no term in it.

**The rule** (:data:`FIT`, least squares over the grid's cells, :func:`fit`): for each of the
10th, 50th and 90th percentiles of the layers' imbalance I (the busiest expert's load over the
mean), ``ln(I - 1) = c0 + cE ln E + cK ln K + cT ln T + cH ln H``, then I kept in ``[1, E / K]``
(an expert takes at most one of each token's K choices).

**The loads.** The per-expert shares at an imbalance I are a log-normal profile: share ``e``
proportional to ``exp(s z_e)`` with ``z_e`` the standard normal's quantiles at ``(e + 0.5) /
E``, ``s`` solved so that the busiest share is ``I / E``; the experts are placed in a fixed
shuffle (a fresh router's experts are exchangeable; which rank gets the hot ones is chance),
one row standing for every layer. How far the profile is from the measured sorted shares is
recorded by the benchmark's check (:func:`profile_error`).

Torch-free.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moesaic.checks import check_positive_int

__all__ = [
    "FIT",
    "QUANTILES",
    "RoutingPrior",
    "fit",
    "imbalance",
    "largest_source_factor",
    "profile_error",
    "shares",
]

QUANTILES = (0.1, 0.5, 0.9)
# quantile -> (c0, cE, cK, cT, cH) of ln(I - 1); fitted by fit() on
# benchmarks/results/sim_routing_prior.json (tests/sim/test_routing_prior.py refits and compares).
FIT: dict[float, tuple[float, float, float, float, float]] = {
    0.1: (-0.4383, 0.9734, -0.6620, -0.0880, -0.1850),
    0.5: (-1.4089, 1.0698, -0.7805, -0.0719, 0.0492),
    0.9: (-1.5399, 1.0564, -0.8508, -0.0700, 0.1660),
}


def _features(E: int, K: int, T: int, H: int) -> tuple[float, ...]:
    return (1.0, math.log(E), math.log(K), math.log(T), math.log(H))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` by Gaussian elimination with partial pivoting (a small dense system)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit(cells: Iterable[Mapping[str, Any]]) -> dict[float, tuple[float, ...]]:
    """The rule's coefficients, least squares of ``ln(I_q - 1)`` on the features, from the
    benchmark's cells (each with ``experts``, ``top_k``, ``tokens``, ``hidden`` and
    ``imbalance_q``, the 10th, 50th and 90th percentiles)."""
    rows = [(c, _features(c["experts"], c["top_k"], c["tokens"], c["hidden"])) for c in cells]
    out: dict[float, tuple[float, ...]] = {}
    for i, q in enumerate(QUANTILES):
        xs = [(x, math.log(max(c["imbalance_q"][i] - 1.0, 1e-3))) for c, x in rows]
        n = len(xs[0][0])
        a = [[math.fsum(x[j] * x[k] for x, _ in xs) for k in range(n)] for j in range(n)]
        b = [math.fsum(x[j] * y for x, y in xs) for j in range(n)]
        out[q] = tuple(_solve(a, b))
    return out


def imbalance(
    experts: int,
    top_k: int,
    tokens: int,
    hidden: int,
    q: float,
    coefficients: Mapping[float, Sequence[float]] = FIT,
) -> float:
    """The rule's ``q`` percentile (one of ``QUANTILES``) of a fresh router's busiest-expert
    load over the mean, kept in ``[1, E / K]``."""
    for name, v in (("experts", experts), ("top_k", top_k), ("tokens", tokens)):
        check_positive_int(name, v)
    check_positive_int("hidden", hidden)
    if q not in coefficients:
        raise ValueError(f"q ({q}) must be one of {sorted(coefficients)}")
    x = _features(experts, top_k, tokens, hidden)
    value = 1.0 + math.exp(math.fsum(c * f for c, f in zip(coefficients[q], x)))
    return min(max(value, 1.0), experts / top_k)


def _imbalance_at(experts: int, top_k: int, tokens: int, hidden: int, q: float) -> float:
    """The rule's imbalance at any percentile ``q`` in (0, 1): ``ln(I - 1)`` linear in the
    normal quantile of ``q`` between the fitted 10th, 50th and 90th (beyond them, the nearer
    segment's line), kept in ``[1, E / K]``."""
    z = statistics.NormalDist().inv_cdf(q)
    pts = [
        (statistics.NormalDist().inv_cdf(p), imbalance(experts, top_k, tokens, hidden, p))
        for p in QUANTILES
    ]
    (z0, i0), (z1, i1) = (pts[0], pts[1]) if z <= pts[1][0] else (pts[1], pts[2])
    y0, y1 = (math.log(max(i - 1.0, 1e-9)) for i in (i0, i1))
    value = 1.0 + math.exp(y0 + (y1 - y0) * (z - z0) / (z1 - z0))
    return min(max(value, 1.0), experts / top_k)


def largest_source_factor(
    experts: int, top_k: int, source_tokens: int, step_tokens: int, hidden: int, sources: int
) -> float:
    """How much the largest load one source rank sends one expert exceeds the busiest expert's
    share of the world's step, both per token: what a padded exchange without a capacity pads
    to (``strategies.padded``: every rank pads every expert to the largest (source, expert)
    count of the group, one all-reduce MAX), while the loads a run records, and the prior,
    are the world's sums over a step.

    The rule, from the prior's measurements: each of the ``sources`` ranks routes its own
    ``source_tokens`` (one chunk of its batch) as an independent draw of the imbalance at
    those tokens; the largest of ``P`` draws is taken at its median, the prior's percentile
    ``0.5 ** (1 / P)``; over the world's median at ``step_tokens``. At least 1 (one source:
    the world's own busiest, less the tokens' averaging)."""
    check_positive_int("sources", sources)
    q = 0.5 ** (1.0 / sources)
    largest = _imbalance_at(experts, top_k, source_tokens, hidden, q)
    world = imbalance(experts, top_k, step_tokens, hidden, 0.5)
    return max(1.0, largest / world)


def _profile(E: int, s: float) -> list[float]:
    """Log-normal shares busiest first, summing to 1."""
    z = [statistics.NormalDist().inv_cdf((E - e - 0.5) / E) for e in range(E)]
    w = [math.exp(s * v) for v in z]
    total = math.fsum(w)
    return [x / total for x in w]


def _sorted_shares(experts: int, ratio: float) -> list[float]:
    """Shares busiest first whose busiest is ``ratio`` times the mean (bisection on ``s``)."""
    if experts == 1 or ratio <= 1.0 + 1e-9:
        return [1.0 / experts] * experts
    lo, hi = 0.0, 50.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if _profile(experts, mid)[0] * experts < ratio:
            lo = mid
        else:
            hi = mid
    return _profile(experts, (lo + hi) / 2)


def shares(experts: int, ratio: float) -> tuple[float, ...]:
    """One layer's shares per expert at imbalance ``ratio``, in placement order (the sorted
    log-normal profile in a fixed shuffle of the experts)."""
    check_positive_int("experts", experts)
    if not 1.0 <= ratio <= experts:
        raise ValueError(f"ratio ({ratio}) must be in [1, experts ({experts})]")
    ranked = _sorted_shares(experts, ratio)
    place = list(range(experts))
    random.Random(experts).shuffle(place)
    out = [0.0] * experts
    for share, e in zip(ranked, place):
        out[e] = share
    return tuple(out)


def profile_error(experts: int, ratio: float, measured_sorted: Sequence[float]) -> float:
    """The largest gap between the profile's sorted shares at ``ratio`` and measured ones, as
    a fraction of the mean share (``1 / experts``)."""
    profile = _sorted_shares(experts, ratio)
    return max(abs(a - b) for a, b in zip(profile, measured_sorted)) * experts


@dataclass(frozen=True, slots=True)
class RoutingPrior:
    """The prior for one job: its shape and the rule's imbalance percentiles.

    Attributes:
        experts, top_k, hidden: the model's E, K, H.
        tokens: the tokens of one step over the world (what the loads are summed over).
        imbalances: the 10th, 50th and 90th percentiles of the busiest expert over the mean.
    """

    experts: int
    top_k: int
    tokens: int
    hidden: int
    imbalances: tuple[float, float, float]

    @classmethod
    def of(cls, experts: int, top_k: int, tokens: int, hidden: int) -> RoutingPrior:
        values = tuple(imbalance(experts, top_k, tokens, hidden, q) for q in QUANTILES)
        lo, mid, hi = sorted(values)
        return cls(experts, top_k, tokens, hidden, (lo, mid, hi))

    def rows(self, which: int) -> tuple[tuple[float, ...]]:
        """The loads at the ``which``-th percentile (0: 10th, 1: 50th, 2: 90th), one row
        standing for every MoE layer (``ModelSpec.measured_loads``)."""
        return (shares(self.experts, self.imbalances[which]),)

    def describe(self) -> str:
        lo, mid, hi = self.imbalances
        return (
            f"no routing given (data, --loads or measured routing): the routing prior of a "
            f"fresh router, E {self.experts}, top-{self.top_k}, {self.tokens} tokens per step: "
            f"the busiest expert {mid:.2f}x the mean (10th-90th percentile {lo:.2f}-{hi:.2f}x)"
        )
