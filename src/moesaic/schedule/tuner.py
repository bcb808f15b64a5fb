"""Online tuning of the all-reduce chunk size Sp (FlowMoE App. D): Bayesian optimisation.

Torch-free. The objective is the training iteration time as a function of x = log2(Sp) on
[log2(low), log2(high)]: each sample runs ``iters_per_sample`` iterations at one Sp and scores
their mean. A Gaussian process with a Matern (nu = 2.5) kernel models the times, and expected
improvement picks the next Sp; after ``samples`` samples the Sp with the lowest mean time is
kept. While it is kept, the mean of the last ``iters_per_sample`` iterations is compared with
the time it was chosen at: a relative change above ``drift`` starts a new search (the load or the
network changed; the old samples describe another regime and are dropped).

The GP and the acquisition come from the ``bayesian-optimization`` package (``bayes_opt``):
maintained (3.x, 2025-26 releases), small, pure Python over scikit-learn and scipy, and no torch
or CUDA dependency (BoTorch would pull a second torch stack; scikit-optimize's last release is
from 2024). It maximises, so the target is the negated time.

The tuner is per process and deterministic for a given seed and observation sequence; in a
distributed run rank 0 owns it and broadcasts ``current()`` so every rank cuts the same chunks.
"""

from __future__ import annotations

import contextlib
import io
import math
import warnings
from collections.abc import Iterator
from typing import Any

from moesaic.checks import check_int, check_non_negative, check_positive, check_positive_int

__all__ = ["SpTuner"]

# Where the first samples go (``initial``), as fractions of the log2 range: "spread" (ours),
# three fixed points, a spread the GP needs before EI is informative (3 of the 8 default
# samples); "random" (the paper's App. D.1), one point drawn uniformly.
_INIT_FRACTIONS = (0.15, 0.5, 0.85)
INITIAL = ("spread", "random")


@contextlib.contextmanager
def _quiet_gp() -> Iterator[None]:
    """Silence scikit-learn's "hyperparameter close to its bound" warning: with near-noiseless
    samples the noise level sits at its lower bound, which is the right answer, not a fault."""
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        yield


class SpTuner:
    """Bayesian optimisation of Sp (bytes) over measured iteration times.

    Args:
        low: smallest Sp tried, bytes (>= 1).
        high: largest Sp tried, bytes (> low).
        samples: Sp values evaluated per search (>= 2).
        iters_per_sample: iterations averaged per sample (>= 1).
        drift: relative change of the iteration time that starts a new search (> 0).
        seed: seeds the acquisition's random restarts (and the "random" initial point).
        xi: the improvement expected improvement asks for, as a fraction of the first
            sample's time (>= 0; the paper's App. D.1 uses 0.1 on its own scale).
        initial: the first samples: "spread" (3 fixed points of the log range) or "random"
            (one uniform point, App. D.1).
    """

    def __init__(
        self,
        *,
        low: int,
        high: int,
        samples: int = 8,
        iters_per_sample: int = 5,
        drift: float = 0.2,
        seed: int = 0,
        xi: float = 0.01,
        initial: str = "spread",
    ) -> None:
        self.low = check_positive_int("low", low)
        self.high = check_positive_int("high", high)
        if self.high <= self.low:
            raise ValueError(f"high ({high}) must be > low ({low})")
        self.samples = check_int("samples", samples, 2)
        self.iters_per_sample = check_positive_int("iters_per_sample", iters_per_sample)
        self.drift = check_positive("drift", drift)
        self.seed = check_int("seed", seed)
        self.xi = check_non_negative("xi", xi)
        if initial not in INITIAL:
            raise ValueError(f"initial must be one of {', '.join(INITIAL)}, got {initial!r}")
        self.initial = initial
        self.searches = 0  # searches started (the first one included)
        self.history: list[tuple[int, float]] = []  # (Sp, mean time) of every sample
        self._times: list[float] = []
        self._best: tuple[int, float] | None = None  # kept (Sp, time) once a search ended
        self._start_search()

    # -- public ------------------------------------------------------------------------------
    @property
    def tuning(self) -> bool:
        """True while a search is running (``current()`` is a sample, not the choice)."""
        return self._best is None

    def current(self) -> int:
        """The Sp (bytes) to use for the next iteration."""
        return self._best[0] if self._best is not None else self._sp

    def observe(self, iteration_time_s: float) -> None:
        """Record one iteration's time, measured at ``current()``."""
        t = check_non_negative("iteration_time_s", iteration_time_s)
        self._times.append(t)
        if len(self._times) < self.iters_per_sample:
            return
        mean = sum(self._times) / len(self._times)
        self._times = []
        if self._best is None:
            self._record(mean)
        elif abs(mean - self._best[1]) > self.drift * self._best[1]:
            self._start_search()

    # -- search ------------------------------------------------------------------------------
    def _bounds(self) -> tuple[float, float]:
        return math.log2(self.low), math.log2(self.high)

    def _to_sp(self, x: float) -> int:
        return min(self.high, max(self.low, round(2.0**x)))

    def _start_search(self) -> None:
        import numpy as np

        try:
            from bayes_opt import acquisition  # lazily: scikit-learn takes ~1 s to import
            from bayes_opt.target_space import TargetSpace
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "schedule 'flowmoe' tunes its gradient all-reduce chunk Sp online with the "
                "bayesian-optimization package, which is not installed: pip install "
                "'moesaic[flowmoe]', or fix Sp instead (ar_chunk in the training config, "
                "--ar-chunk on the command line)"
            ) from exc
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import Matern, WhiteKernel

        self.searches += 1
        seed = self.seed + self.searches - 1
        self._best = None
        self._x: list[float] = []
        self._y: list[float] = []
        self._space: Any = TargetSpace(
            None, {"x": self._bounds()}, random_state=seed, allow_duplicate_points=True
        )
        # Matern(nu=2.5) over log2(Sp), length scale >= 2 octaves: the time is a smooth blend
        # of per-chunk latency and lost overlap; with the first 3 samples ~5 octaves apart a
        # shorter scale is what maximum likelihood picks, which makes EI flat between samples
        # (seen: its maximum jumped between runs). Plus a learned noise term: a sample is the
        # mean of a few noisy iterations, not an exact value.
        kernel = Matern(nu=2.5, length_scale=4.0, length_scale_bounds=(2.0, 64.0))
        kernel += WhiteKernel(noise_level=1e-2, noise_level_bounds=(1e-6, 1.0))
        self._gp: Any = GaussianProcessRegressor(
            kernel=kernel, normalize_y=True, n_restarts_optimizer=1, random_state=seed
        )
        # xi: the improvement EI asks for, in units of the first sample's time (targets are
        # -time / first time): 0.01 = 1%
        self._acq: Any = acquisition.ExpectedImprovement(xi=self.xi)
        self._rng: Any = np.random.RandomState(seed)
        self._next_point()

    def _next_point(self) -> None:
        lo, hi = self._bounds()
        k = len(self._x)
        if self.initial == "random" and k == 0:
            x = float(lo + self._rng.uniform() * (hi - lo))
        elif self.initial == "spread" and k < min(len(_INIT_FRACTIONS), self.samples):
            x = lo + _INIT_FRACTIONS[k] * (hi - lo)
        else:  # the EI maximum of the GP posterior (1-D: 2000 random points + 3 L-BFGS-B)
            x = float(
                self._acq.suggest(gp=self._gp, target_space=self._space, n_random=2000, n_smart=3)[
                    0
                ]
            )
        self._x_now = x
        self._sp = self._to_sp(x)

    def _record(self, mean_s: float) -> None:
        self._x.append(self._x_now)
        self._y.append(mean_s)
        self.history.append((self._sp, mean_s))
        ref = self._y[0] if self._y[0] > 0 else 1.0
        # A repeated point is kept (a sample is a noisy mean; the GP's noise term averages the
        # repeats), but bayes_opt prints a coloured "Data point ... is not unique" line to
        # stdout for each: seen after ~30 FlowMoE steps even with --no-progress.
        with contextlib.redirect_stdout(io.StringIO()):
            self._space.register({"x": self._x_now}, -mean_s / ref)
        if len(self._x) < self.samples:
            self._next_point()
            return
        # keep the sampled Sp the GP rates fastest (its posterior mean averages out the noise
        # of single samples), with that sample's measured time as the drift reference
        with _quiet_gp():
            self._gp.fit(self._space.params, self._space.target)
        mean_S = self._gp.predict([[x] for x in self._x]).tolist()
        i = max(range(len(mean_S)), key=mean_S.__getitem__)
        self._best = (self._to_sp(self._x[i]), self._y[i])
