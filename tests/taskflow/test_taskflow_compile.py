"""Static scheduler: events and thresholds, RATR, GMM interleaving, deadlock detection."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from moesaic.taskflow import (
    CompileOptions,
    PlanDeadlockError,
    ShapeBucket,
    check_plan,
    check_world,
    compile_plan,
    compile_world,
    plan_to_dict,
    simulate,
)
from moesaic.taskflow.compile import INTERLEAVE_PAIRS

# P=4, e=2, S=4 (2 dispatch tiles of 2 rows per slot), 13 tokens (a partial token tile).
BUCKETS = {
    "ep1": ShapeBucket(tokens=13, hidden=8, ffn=6, experts=4, top_k=2, ep_size=1, slot_rows=4,
                       tile_m=2),
    "ep4": ShapeBucket(tokens=13, hidden=8, ffn=6, experts=8, top_k=2, ep_size=4, slot_rows=4,
                       tile_m=2),
    "ep4-gelu-coarse-gmm": ShapeBucket(tokens=5, hidden=8, ffn=6, experts=8, top_k=3,
                                       ep_size=4, slot_rows=8, tile_m=2, gmm_tile_m=4,
                                       activation="gelu"),
    # one local expert per rank (Mixtral-like): the natural w-grad split is a single task
    "ep4-one-expert": ShapeBucket(tokens=6, hidden=8, ffn=6, experts=4, top_k=2, ep_size=4,
                                  slot_rows=4, tile_m=2),
}  # fmt: skip
NAIVE = CompileOptions(ratr=False, interleave=False)


@pytest.fixture(scope="module")
def worlds():
    return {
        (name, d, naive): compile_world(b, d, NAIVE if naive else None)
        for name, b in BUCKETS.items()
        for d in ("forward", "backward")
        for naive in (False, True)
    }


def _deps(plan):
    """(producer uid, consumer uid) for every local dependency."""
    uid = {(t.op, t.task_index): t.uid for t in plan.tasks}
    return [
        (uid[(p.op, p.task_index)], t.uid)
        for t in plan.tasks
        if t.dependent_event >= 0
        for p in plan.events[t.dependent_event].producers
        if p.rank == plan.rank
    ]


@pytest.mark.parametrize("name", list(BUCKETS))
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_every_threshold_equals_its_producer_count_across_the_world(worlds, name, direction):
    plans = worlds[(name, direction, False)]
    fired = Counter()
    for p in plans:
        for t in p.tasks:
            for ref in t.trigger_events:
                fired[(ref.rank, ref.event)] += 1
    for p in plans:
        for ev in p.events:
            # Counted from the tasks of every rank that really trigger it, not from the
            # event's own producer list.
            assert ev.threshold == fired[(p.rank, ev.id)] == len(ev.producers) >= 1


def test_many_to_many_events_exist():
    plan = compile_plan(BUCKETS["ep4"], "backward", 2)
    thr = Counter(ev.threshold for ev in plan.events)
    # w-grad GMMs wait on all P*S/tile = 8 row tiles of their expert; the source-side reduce
    # waits on all E*S/tile = 16 combine tiles coming back; the rest are 1:1 tile edges.
    assert thr == {1: thr[1], 8: 4, 16: 1}
    # One dispatched tile releases two consumers with different producer sets (its GMM tile,
    # and the whole-expert w2-grad GMM): it triggers two events.
    assert max(len(t.trigger_events) for t in plan.tasks) == 2


@pytest.mark.parametrize("name", ["ep4", "ep4-gelu-coarse-gmm"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_ratr_is_a_legal_permutation_that_spreads_destinations(worlds, name, direction):
    opt, naive = worlds[(name, direction, False)], worlds[(name, direction, True)]
    P = BUCKETS[name].ep_size
    for p, q in zip(opt, naive):
        for queue in ("matrix", "vector"):
            assert sorted(p.queue(queue)) == sorted(q.queue(queue))  # a permutation
        assert p.queue("vector") != q.queue("vector")  # and really a different order
        pos = {uid: i for queue in ("matrix", "vector") for i, uid in enumerate(p.queue(queue))}
        for a, b in _deps(p):
            if p.schedule.queue_of()[a] == p.schedule.queue_of()[b]:
                assert pos[a] < pos[b], "same-queue dependency reordered"
    check_world(opt)  # cross-queue and cross-rank dependencies: no deadlock anywhere
    for op in ("dispatch", "combine") if direction == "forward" else ("dispatch_bwd",):
        seq = [[p.tasks[u].peer for u in p.queue("vector") if p.tasks[u].op == op] for p in opt]
        naive_seq = [[q.tasks[u].peer for u in q.queue("vector") if q.tasks[u].op == op]
                     for q in naive]  # fmt: skip
        assert len({s[0] for s in naive_seq}) == 1  # naive: every rank starts at one rank
        assert len({s[0] for s in seq}) == P  # RATR: no two ranks start at one destination
        for step in zip(*seq):  # and at every step all ranks write different destinations
            assert len(set(step)) == P


@pytest.mark.parametrize("name", ["ep4", "ep4-one-expert"])
def test_interleaving_is_a_legal_permutation_grouped_by_expert(worlds, name):
    opt, naive = worlds[(name, "backward", False)], worlds[(name, "backward", True)]
    for p, q in zip(opt, naive):
        assert sorted(p.queue("matrix")) == sorted(q.queue("matrix"))
        pos = {uid: i for i, uid in enumerate(p.queue("matrix"))}
        for a, b in _deps(p):
            if a in pos and b in pos:  # both on the matrix queue
                assert pos[a] < pos[b]
        for pair in INTERLEAVE_PAIRS:
            run = [p.tasks[u] for u in p.queue("matrix") if p.tasks[u].op in pair]
            experts = [t.expert for t in run]
            assert experts == sorted(experts)  # expert by expert
            for j in set(experts):  # each expert's w-grad GMM right after its row tiles
                ops = [t.op for t in run if t.expert == j]
                assert ops == [pair[0]] * (len(ops) - 1) + [pair[1]]
        # an activation-gradient tile leads (never a whole-expert w-grad sink)
        assert p.tasks[p.queue("matrix")[0]].op == "gmm_act_grad"
    check_world(opt)


def test_ordering_optimisations_do_not_lengthen_the_nominal_makespan():
    b = BUCKETS["ep4"]
    from moesaic.taskflow.draw import nominal_cost

    def span(opts):
        world = compile_world(b, "forward", opts)
        return simulate(world, world=True, cost=lambda t: nominal_cost(t, b.tile_m)).makespan

    assert span(None) <= span(NAIVE)


def _swap_reduce_first(plan):
    """A planted bad order: the top-k reduce ahead of everything in the vector queue."""
    reduce = [u for u in plan.queue("vector") if plan.tasks[u].op == "reduce"]
    rest = [u for u in plan.queue("vector") if plan.tasks[u].op != "reduce"]
    return dataclasses.replace(plan, schedule=plan.schedule.with_queue("vector", reduce + rest))


def test_deadlock_check_catches_a_planted_bad_order():
    plan = compile_plan(BUCKETS["ep1"], "forward", 0)
    with pytest.raises(PlanDeadlockError, match=r"vector queue at position 0 \(reduce\[0\]\)"):
        check_plan(_swap_reduce_first(plan))


def test_world_deadlock_that_no_single_rank_can_see():
    # Rank 0 sends its dispatch tiles for rank 1 only after its own reduce; the reduce waits for
    # combine tiles from rank 1, which wait for those very tiles. Each plan alone is fine (it
    # assumes remote writes arrive); the world simulation finds the cycle.
    plans = compile_world(BUCKETS["ep4"], "forward")
    p0 = plans[0]
    late = [u for u in p0.queue("vector") if p0.tasks[u].op == "dispatch" and p0.tasks[u].peer == 1]
    early = [u for u in p0.queue("vector") if u not in late]
    plans[0] = dataclasses.replace(p0, schedule=p0.schedule.with_queue("vector", early + late))
    check_plan(plans[0])
    with pytest.raises(PlanDeadlockError, match="rank 0 vector queue"):
        check_world(plans)


def test_compile_is_deterministic():
    b = BUCKETS["ep4"]
    assert plan_to_dict(compile_plan(b, "backward", 3)) == plan_to_dict(
        compile_plan(b, "backward", 3)
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"slot_rows": 5}, "slot_rows .5. must be a multiple"),
        ({"gmm_tile_m": 3}, "gmm_tile_m .3. must be a multiple of tile_m"),
        ({"experts": 6}, r"experts \(6\) must be divisible by the expert-parallel size"),
        ({"top_k": 9}, r"top_k \(9\) must be <= experts"),
        ({"activation": "relu"}, "activation"),
        ({"tokens": 0}, r"tokens \(0\) must be > 0"),
    ],
)
def test_bad_buckets_name_the_field(kwargs, match):
    base = {"tokens": 4, "hidden": 8, "ffn": 6, "experts": 8, "top_k": 2, "ep_size": 4,
            "slot_rows": 4, "tile_m": 2}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        ShapeBucket(**{**base, **kwargs})


def test_bad_compile_arguments():
    b = BUCKETS["ep4"]
    with pytest.raises(ValueError, match=r"rank \(4\) must be an int in \[0, ep_size=4\)"):
        compile_plan(b, "forward", 4)
    with pytest.raises(ValueError, match="direction"):
        compile_plan(b, "sideways", 0)
    with pytest.raises(ValueError, match="unknown operators"):
        compile_plan(b, "forward", 0, CompileOptions(unsplit=("gmm9",)))
