"""SpTuner: Bayesian optimisation of the all-reduce chunk size over noisy iteration times."""

from __future__ import annotations

import math
import random

import pytest

from moesaic.schedule.tuner import SpTuner

LOW, HIGH = 2**10, 2**26
X_BEST = 21.3  # log2 of the true minimiser: off the grid of the first samples (12.4, 18, 23.6)


def _iteration_time(sp: int, rng: random.Random, *, scale: float = 1.0) -> float:
    """Unimodal in log2(Sp) (small chunks pay latency, large ones lose overlap), 3% noise."""
    x = math.log2(sp)
    return scale * 0.1 * (1.0 + 0.03 * (x - X_BEST) ** 2) * (1.0 + rng.gauss(0.0, 0.03))


def _run_search(tuner: SpTuner, rng: random.Random, *, scale: float = 1.0) -> int:
    iterations = 0
    while tuner.tuning:
        tuner.observe(_iteration_time(tuner.current(), rng, scale=scale))
        iterations += 1
    return iterations


@pytest.mark.parametrize("seed", [0, 1])
def test_tuner_finds_the_minimum_of_a_noisy_unimodal_function(seed):
    rng = random.Random(1000 + seed)
    tuner = SpTuner(low=LOW, high=HIGH, samples=8, iters_per_sample=3, seed=seed)
    # budget: 8 samples x 3 iterations, then the choice is fixed
    assert _run_search(tuner, rng) == 8 * 3
    assert len(tuner.history) == 8
    chosen = tuner.current()
    # within a factor 2 of the true minimiser (1 octave of a 16-octave range); the 3% noise
    # equals the objective's rise over ~1 octave around the minimum, so finer is luck
    assert abs(math.log2(chosen) - X_BEST) <= 1.0, (chosen, tuner.history)
    assert chosen in [sp for sp, _ in tuner.history]  # the best sample, not an extrapolation
    # after the search the choice stays put while the times hold
    for _ in range(10):
        tuner.observe(_iteration_time(chosen, rng))
    assert tuner.current() == chosen and not tuner.tuning and tuner.searches == 1


def test_the_papers_settings_find_the_minimum_too(seed=0):
    """App. D.1's settings: one random first sample, EI xi = 0.1 (here 10% of the first
    sample's time); the first sample is the seeded draw, not one of the spread's points."""
    rng = random.Random(2000 + seed)
    tuner = SpTuner(
        low=LOW, high=HIGH, samples=8, iters_per_sample=3, seed=seed, xi=0.1, initial="random"
    )
    first = math.log2(tuner.current())
    lo, hi = math.log2(LOW), math.log2(HIGH)
    assert all(abs(first - (lo + f * (hi - lo))) > 0.01 for f in (0.15, 0.5, 0.85))
    assert _run_search(tuner, rng) == 8 * 3
    # a 10% xi explores more: within 1.5 octaves of the minimiser (measured: 0.1-0.9 for
    # seeds 0-5), the same budget as the default's test
    assert abs(math.log2(tuner.current()) - X_BEST) <= 1.5, tuner.history
    again = SpTuner(low=LOW, high=HIGH, seed=seed, xi=0.1, initial="random")
    assert math.log2(again.current()) == pytest.approx(first)  # the draw is the seed's


def test_tuner_retunes_when_the_iteration_time_drifts():
    rng = random.Random(7)
    tuner = SpTuner(low=LOW, high=HIGH, samples=4, iters_per_sample=2, drift=0.2, seed=0)
    _run_search(tuner, rng)
    assert tuner.searches == 1
    # times 1.5x (a slower network): above the 20% drift after one averaged window
    tuner.observe(_iteration_time(tuner.current(), rng, scale=1.5))
    assert not tuner.tuning
    tuner.observe(_iteration_time(tuner.current(), rng, scale=1.5))
    assert tuner.tuning and tuner.searches == 2
    assert _run_search(tuner, rng, scale=1.5) == 4 * 2


def test_tuner_is_repeatable_for_a_seed():
    runs = []
    for _ in range(2):
        rng = random.Random(3)
        tuner = SpTuner(low=LOW, high=HIGH, samples=5, iters_per_sample=1, seed=4)
        _run_search(tuner, rng)
        runs.append([sp for sp, _ in tuner.history])
    # the same samples up to ~1%: scipy's L-BFGS-B (GP fit, EI maximum) is not bitwise
    # repeatable here (seen: 2^22.37 vs 2^22.36 bytes); in a run only rank 0 decides
    assert runs[0] == pytest.approx(runs[1], rel=0.03)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"low": 0}, "low"),
        ({"high": 1024}, "high"),  # not above low
        ({"samples": 1}, "samples"),
        ({"iters_per_sample": 0}, "iters_per_sample"),
        ({"drift": 0.0}, "drift"),
        ({"low": 2.5}, "low"),
        ({"xi": -0.1}, "xi"),
        ({"initial": "grid"}, "initial"),
    ],
)
def test_tuner_bad_settings_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpTuner(**{"low": 1024, "high": 2**20, **kwargs})


def test_tuner_bad_time_names_it():
    tuner = SpTuner(low=LOW, high=HIGH)
    with pytest.raises(ValueError, match="iteration_time_s"):
        tuner.observe(float("nan"))


def test_repeated_points_print_nothing(capsys):
    """Issue 25 item 9: bayes_opt prints a coloured "Data point ... is not unique" line for
    every repeated sample (EI's maximum at a bound twice); FlowMoE runs printed them even with
    --no-progress. Force repeats: every suggestion is the lower bound."""
    tuner = SpTuner(low=LOW, high=HIGH, samples=8, iters_per_sample=1, seed=0)
    lo = tuner._bounds()[0]
    tuner._acq.suggest = lambda **_: [lo]
    for _ in range(8):
        tuner.observe(1.0)
    assert tuner._space.n_duplicate_points >= 2  # the repeats happened
    assert capsys.readouterr().out == ""
