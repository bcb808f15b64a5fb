"""The Sp tuner against grid and random search (issue 54 item 3; FlowMoE App. D, Tables A.3,
A.5, A.6), on two emulated clusters.

**The rule that chooses what runs** (fixed on 2026-12-04 at 04:40 UTC and committed before
any of it was measured; nothing in it may change after the first measurement):

Clusters (2 ranks each: 4 ranks oversubscribe the 2 cores, ``flowmoe_pays.py``), flowmoe at
R = 2, Sp searched over [G/64, G] on a log2 scale (G: the replicated gradients' bytes; the
range ``FlowMoEStep`` tunes):

* ``A``: ``examples/clusters/flowmoe_2rank.toml`` with ``benchmarks/flowmoe_cluster.py``'s
  model and batch (the FlowMoE benchmark; 150 Mbit/s, H 128, 4 blocks, F 2048, 512 tokens);
* ``B``: ``flowmoe_pays.py``'s point ``L0.1_F4_T1024_N2`` (100 Mbit/s, H 128, 2 blocks, F 512,
  1024 tokens per rank: where flowmoe paid most over moe-only).

Every search gets **8 trials** (the paper's 8 samples); a trial's time is the mean of its K
steps:

========================  ==============================================================  ===
method                    what it samples                                                 K
========================  ==============================================================  ===
``bo``                    ``SpTuner`` as FlowMoE runs it: 3 spread points, then EI        5
                          (xi 0.01), the sampled Sp the GP rates fastest kept
``bo-paper``              ``SpTuner(xi=0.1, initial="random")``: App. D.1's settings      10
                          (one random first point, EI 0.1, 10 iterations per sample)
``bo-paper-k5``           the same at K = 5 (the settings alone, at our budget)           5
``grid``                  8 points evenly spaced on the log range, ends included          5
                          (App. D.3: the space in 8 parts), the fastest mean kept
``random``                8 uniform draws on the log range (seed 0), the fastest kept     5
``bo-straddled``          ``bo`` with the step's windows counted as before the tuner      5
                          setter (from the step's first run, not the tuner's: each
                          window straddles two samples): the before of that fix
========================  ==============================================================  ===

All searches run in one world, round-robin (a FlowMoE step and model copy each, same seed, one
step of each per round, a barrier before each step), so the machine's noise falls on all alike.
Then ``EVAL_ROUNDS`` rounds measure, side by side, each method's kept Sp and a **reference
curve**: 7 Sp evenly spaced on the log range, ends included (one more step object, its Sp set
before each step). The best time = the lowest median among the reference points and the kept
Sp's. Reported per method: the median step time at its kept Sp and its ratio to the best
(Table A.3's "time reached"), and the trials it took to reach within 5% of the best: the first
trial whose Sp the reference curve (linear in log2 Sp between its points) puts within 5% of the
best (trial k costs k x K steps). The paper's "random number generation" (a new random Sp each
iteration, no choice) is the reference curve's mean (uniform in log2 Sp), reported beside.

**Overhead (Table A.6)**: on rank 0 the time spent in the tuner's ``observe`` (the GP fit and
the EI maximum, once per trial) and in the step's agreement on Sp (``_next_chunk_bytes``: one
all-gather per trial), per method, over the search; as a share of 1000 steps at the kept Sp
(the paper's "first 1000 iterations"); the first ``SpTuner``'s construction (importing
scikit-learn and bayes_opt) apart.

Usage (root)::

    python benchmarks/seeds/flowmoe_tuner.py --cluster A [--eval-rounds 6]

writes its part of ``benchmarks/results/seeds_flowmoe_tuner.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the harness

TRIALS = 8
METHODS: list[tuple[str, int]] = [
    ("bo", 5),
    ("bo-paper", 10),
    ("bo-paper-k5", 5),
    ("grid", 5),
    ("random", 5),
    ("bo-straddled", 5),
]
# The step's window count offset by WARMUP for "bo-straddled": how FlowMoEStep counted before
# the tuner setter (a tuner set after the warm-up steps had each sample's window straddle two
# Sp values; benchmarks/flowmoe_cluster.py's tuned rows ran so): the fix's "before".
REFERENCE_POINTS = 7
EVAL_ROUNDS = 6
WARMUP = 2
WITHIN = 1.05
R = 2
OUT = Path("benchmarks/results/seeds_flowmoe_tuner.json")


class ListSearch:
    """Grid or random search with the tuner's interface (``FlowMoEStep.tuner``): the given Sp
    in turn, ``iters_per_sample`` steps each, then the one with the lowest mean kept."""

    def __init__(self, sps: list[int], iters_per_sample: int) -> None:
        self.sps, self.iters_per_sample = sps, iters_per_sample
        self.history: list[tuple[int, float]] = []
        self.searches = 1
        self._times: list[float] = []
        self._best: int | None = None

    @property
    def tuning(self) -> bool:
        return self._best is None

    def current(self) -> int:
        return self._best if self._best is not None else self.sps[len(self.history)]

    def observe(self, t: float) -> None:
        if self._best is not None:
            return
        self._times.append(t)
        if len(self._times) < self.iters_per_sample:
            return
        self.history.append((self.current(), sum(self._times) / len(self._times)))
        self._times = []
        if len(self.history) == len(self.sps):
            self._best = min(self.history, key=lambda h: h[1])[0]


def log_points(low: int, high: int, n: int) -> list[int]:
    a, b = math.log2(low), math.log2(high)
    return [round(2 ** (a + k * (b - a) / (n - 1))) for k in range(n)]


def make_searcher(method: str, K: int, low: int, high: int) -> Any:
    from moesaic.schedule.tuner import SpTuner

    if method in ("bo", "bo-straddled"):
        return SpTuner(low=low, high=high, samples=TRIALS, iters_per_sample=K, drift=0.5)
    if method.startswith("bo-paper"):
        return SpTuner(
            low=low, high=high, samples=TRIALS, iters_per_sample=K, drift=0.5,
            xi=0.1, initial="random",
        )  # fmt: skip
    if method == "grid":
        return ListSearch(log_points(low, high, TRIALS), K)
    rng = random.Random(0)
    a, b = math.log2(low), math.log2(high)
    return ListSearch([round(2 ** rng.uniform(a, b)) for _ in range(TRIALS)], K)


def _setup(cluster: str) -> tuple[Any, dict[str, Any], int, str]:
    """(cluster spec, harness MODEL, BATCH, name) of cluster ``A`` or ``B``."""
    from flowmoe_pays import _work, model_dict, points

    import flowmoe_cluster as fc
    from moesaic.cluster.spec import ClusterSpec

    if cluster == "A":
        return ClusterSpec.from_toml(fc.DEFAULT_CLUSTER), fc.MODEL, fc.BATCH, "flowmoe_2rank"
    p = next(q for q in points() if q["name"] == "L0.1_F4_T1024_N2")
    spec = ClusterSpec.from_toml(str(_work(p) / "cluster.toml"))
    return spec, model_dict(p), p["seqs"], p["name"]


class _Timed:
    """Wraps a callable and sums the seconds spent in it."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *a: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*a)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def worker(
    rank: int, world: int, model: dict[str, Any], batch: int, eval_rounds: int, smoke: bool
) -> Any:
    global TRIALS, METHODS
    if smoke:
        TRIALS, METHODS = 3, [(m, 1) for m, _ in METHODS]
    import torch
    import torch.distributed as dist

    import flowmoe_cluster as fc
    from moesaic.train.parallel import build_layout

    fc.MODEL, fc.BATCH = model, batch
    torch.set_num_threads(1)
    layout = build_layout(ep_size=world, timeout_s=120.0)
    batches = fc._batches(rank, 4)
    config = ("flowmoe", "flowmoe", R, "all")
    steps = [fc._build(layout, rank, config) for _ in range(len(METHODS) + 1)]
    for step in steps:
        for i in range(WARMUP):
            step.run(batches[i][:, :-1], batches[i][:, 1:])
    G = fc._replicated_bytes(steps[0].parts.model)
    high = max(8192, G)
    low = max(4096, high // 64)
    t0 = time.perf_counter()
    make_searcher("bo", 5, low, high)  # the first import of scikit-learn and bayes_opt
    import_s = time.perf_counter() - t0
    observe, agree = [], []
    for (method, K), step in zip(METHODS, steps):
        step.tuner = make_searcher(method, K, low, high)
        if method == "bo-straddled":
            step._observed = WARMUP
        observe.append(_Timed(step.tuner.observe))
        step.tuner.observe = observe[-1]
        agree.append(_Timed(step._next_chunk_bytes))
        step._next_chunk_bytes = agree[-1]
    search_times: list[list[float]] = [[] for _ in METHODS]
    budget = [TRIALS * K for _, K in METHODS]
    i = 0
    while any(len(t) < b for t, b in zip(search_times, budget)):
        x = batches[i % len(batches)]
        for k, step in enumerate(steps[: len(METHODS)]):
            if len(search_times[k]) >= budget[k]:
                continue
            dist.barrier()
            t = time.perf_counter()
            step.run(x[:, :-1], x[:, 1:])
            search_times[k].append(time.perf_counter() - t)
        i += 1
    # every rank needs the kept Sp (rank 0's searchers decided): one all-gather
    kept_mine = [s.tuner.current() if rank == 0 else 0 for s in steps[: len(METHODS)]]
    kept_all = [None] * world
    dist.all_gather_object(kept_all, kept_mine)
    kept = kept_all[0]
    trials = [[sp for sp, _ in s.tuner.history] if rank == 0 else [] for s in steps[:-1]]
    trial_s = [[t for _, t in s.tuner.history] if rank == 0 else [] for s in steps[:-1]]
    searches = [s.tuner.searches for s in steps[:-1]]
    for step in steps[: len(METHODS)]:
        step.tuner = None  # fixed at its kept Sp from now on
    for step, sp in zip(steps, kept):
        step._chunk_bytes = sp
    probe = steps[-1]
    refs = log_points(low, high, REFERENCE_POINTS)
    evals: list[list[float]] = []
    for j in range(eval_rounds):
        x = batches[j % len(batches)]
        row = []
        for step in steps[: len(METHODS)]:
            dist.barrier()
            t = time.perf_counter()
            step.run(x[:, :-1], x[:, 1:])
            row.append(time.perf_counter() - t)
        for sp in refs:
            probe._chunk_bytes = sp
            dist.barrier()
            t = time.perf_counter()
            probe.run(x[:, :-1], x[:, 1:])
            row.append(time.perf_counter() - t)
        evals.append(row)
    for step in steps:
        step.close()
    return {
        "G": G, "low": low, "high": high, "refs": refs, "kept": kept,
        "search_times": search_times, "evals": evals, "import_s": import_s,
        "observe_s": [o.seconds for o in observe], "agree_s": [a.seconds for a in agree],
        "agree_calls": [a.calls for a in agree], "trials": trials, "trial_s": trial_s,
        "searches": searches,
    }  # fmt: skip


def _interp(refs: list[int], times: list[float], sp: int) -> float:
    """The reference curve at ``sp``: linear in log2(Sp) between its points."""
    xs = [math.log2(r) for r in refs]
    x = min(max(math.log2(sp), xs[0]), xs[-1])
    for k in range(len(xs) - 1):
        if x <= xs[k + 1]:
            w = (x - xs[k]) / (xs[k + 1] - xs[k])
            return times[k] + w * (times[k + 1] - times[k])
    return times[-1]


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = per_rank[0]
    n = len(METHODS)
    rounds = len(r0["evals"])
    slowest = [[max(r["evals"][j][k] for r in per_rank) for k in range(len(r0["evals"][0]))]
               for j in range(rounds)]  # fmt: skip
    med = [statistics.median(slowest[j][k] for j in range(rounds)) for k in range(len(slowest[0]))]
    kept_s, ref_s = med[:n], med[n:]
    best = min(kept_s + ref_s)
    out: dict[str, Any] = {
        "G_bytes": r0["G"], "low": r0["low"], "high": r0["high"],
        "reference": [{"sp": sp, "step_s": t} for sp, t in zip(r0["refs"], ref_s)],
        "best_s": best,
        "random_each_iteration_s": statistics.mean(ref_s),
        "import_s": r0["import_s"],
        "methods": {},
    }  # fmt: skip
    for k, (method, K) in enumerate(METHODS):
        trials = r0["trials"][k]
        on_curve = [_interp(r0["refs"], ref_s, sp) for sp in trials]
        first = next((i + 1 for i, t in enumerate(on_curve) if t <= WITHIN * best), None)
        search = [max(r["search_times"][k][i] for r in per_rank)
                  for i in range(len(r0["search_times"][k]))]  # fmt: skip
        overhead = r0["observe_s"][k] + r0["agree_s"][k]
        out["methods"][method] = {
            "iters_per_trial": K,
            "trials_sp": trials,
            "trials_mean_s": r0["trial_s"][k],
            "kept_sp": r0["kept"][k],
            "step_s_at_kept": kept_s[k],
            "over_best": kept_s[k] / best,
            "trials_to_within_5pct": first,
            "steps_to_within_5pct": None if first is None else first * K,
            "search_steps": len(search),
            "search_mean_step_s": statistics.mean(search),
            "searches": r0["searches"][k],
            "observe_s": r0["observe_s"][k],
            "agree_s": r0["agree_s"][k],
            "agree_calls": r0["agree_calls"][k],
            "overhead_per_search_step_ms": 1e3 * overhead / len(search),
            "overhead_share_of_1000_steps": overhead / (1000 * kept_s[k]),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", choices=["A", "B"], required=True)
    ap.add_argument("--eval-rounds", type=int, default=EVAL_ROUNDS)
    ap.add_argument(
        "--smoke", action="store_true", help="no emulated network, 3 trials of 1 step, not saved"
    )
    args = ap.parse_args()
    import flowmoe_tuner as mod  # workers unpickle the worker by this module name

    from moesaic.bench.meta import run_metadata

    spec, model, batch, name = _setup(args.cluster)
    load = os.getloadavg()
    t0 = time.perf_counter()
    if args.smoke:
        from moesaic.comm.world import run_world

        global METHODS
        METHODS = [(m, 1) for m, _ in METHODS]
        per_rank = run_world(mod.worker, spec.world_size, model, batch, 1, True,
                             timeout_s=1800.0, pg_timeout_s=120.0)  # fmt: skip
    else:
        from moesaic.cluster import EmulatedCluster

        with EmulatedCluster(spec) as cluster:
            per_rank = cluster.run(
                mod.worker, spec.world_size, model, batch, args.eval_rounds, False,
                timeout_s=1800.0,
            )  # fmt: skip
    res = summarize(per_rank)
    part = {
        "cluster": name, "model": model, "batch_per_rank": batch, "R": R,
        "eval_rounds": args.eval_rounds, "wall_s": time.perf_counter() - t0,
        "load_average_1_5_15": {"before": load, "after": os.getloadavg()},
        "meta": run_metadata(), **res,
    }  # fmt: skip
    print(json.dumps({m: {k: v for k, v in r.items() if k in (
        "kept_sp", "step_s_at_kept", "over_best", "trials_to_within_5pct",
        "overhead_per_search_step_ms", "overhead_share_of_1000_steps")}
        for m, r in res["methods"].items()}, indent=1))  # fmt: skip
    print("best", res["best_s"], "reference", res["reference"])
    if args.smoke:
        return 0  # a smoke run is never saved
    doc = json.loads(OUT.read_text()) if OUT.exists() else {}
    doc[args.cluster] = part
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
