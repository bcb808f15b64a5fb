"""Several ranks on one GPU over gloo with CUDA tensors (NCCL refuses two ranks on one GPU):
EP 2 and 4, every strategy against the reference, and every schedule (vanilla, moe-only,
flowmoe) of a small MoEGPT against vanilla, with every rank issuing its collectives in one
order (``record_collectives``, compared for every pair of ranks on the groups both hold).

One spawned world per EP size runs every case; each case's failure comes back with its
traceback, so the test names the strategy and schedule that failed.
"""

from __future__ import annotations

import functools

import pytest
from _gpu_helpers import (
    NEEDS_CUDA,
    STEPS,
    assert_params_close,
    assert_same_order,
    gloo_world,
    layer_cases,
    schedule_cases,
    value_or_fail,
)

from moesaic.comm.world import run_world

pytestmark = NEEDS_CUDA
WORLDS = (2, 4)
# taskflow on CUDA at EP > 1 runs the persistent kernel, whose puts go through symmetric memory:
# one GPU per rank (``comm.symmetric.check_one_rank_per_device``)
SHARED = "symmetric memory needs one GPU per rank"


@functools.cache
def _results(world: int) -> list[dict]:
    return run_world(gloo_world, world, "cuda", device="cuda", backend="gloo", timeout_s=600)


@pytest.mark.parametrize(
    ("world", "case"), [(w, name) for w in WORLDS for name, _, _ in layer_cases(w)]
)
def test_layer_matches_the_reference(world, case):
    per_rank = [r["layers"][case] for r in _results(world)]
    if case.startswith("taskflow/"):  # ranks sharing one GPU: refused, with a reason
        assert all(SHARED in r.get("error", "") for r in per_rank), per_rank
        return
    for rank, result in enumerate(per_rank):
        value_or_fail(result, f"{case} rank {rank}")
    assert_same_order([r["log"] for r in per_rank], case)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(("schedule", "strategy"), schedule_cases())
def test_schedule_trains_like_vanilla(world, schedule, strategy):
    """Parameters after each of 2 SGD steps equal the vanilla schedule's (of the same strategy
    for the pipelined ones; of dropless for vanilla: nothing drops, so every strategy computes
    the same)."""
    results = _results(world)
    if strategy == "taskflow":  # ranks sharing one GPU: refused, with a reason
        errors = [r["schedules"][(schedule, strategy)].get("error", "") for r in results]
        assert all(SHARED in e for e in errors), errors
        return
    want_case = ("vanilla", strategy if schedule != "vanilla" else "dropless")
    for rank, r in enumerate(results):
        label = f"{schedule}/{strategy} rank {rank}"
        got = value_or_fail(r["schedules"][(schedule, strategy)], label)
        want = value_or_fail(r["schedules"][want_case], f"{want_case} rank {rank}")
        for s in range(STEPS):
            assert_params_close(got["params"][s], want["params"][s], f"{label} step {s}")
    for s in range(STEPS):
        logs = [r["schedules"][(schedule, strategy)]["value"]["logs"][s] for r in results]
        assert_same_order(logs, f"{schedule}/{strategy} step {s}")
