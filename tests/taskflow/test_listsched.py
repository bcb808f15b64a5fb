"""The pipelined (list-scheduled) queue order: a valid, deadlock-free permutation of the compiled
order that starts GMM2 / combine tiles while GMM1 tiles remain, for every rank of a world."""

from __future__ import annotations

import pytest

from moesaic.taskflow import CompileOptions, ShapeBucket, compile_plan, load_plan, save_plan
from moesaic.taskflow.compile import compile_world
from moesaic.taskflow.validate_world import check_world


def _bucket(P: int) -> ShapeBucket:
    return ShapeBucket(tokens=32, hidden=8, ffn=8, experts=8, top_k=2, ep_size=P, slot_rows=8,
                       tile_m=2)  # fmt: skip


@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_pipelined_world_is_a_valid_permutation(P, direction):
    bucket = _bucket(P)
    base = compile_world(bucket, direction, CompileOptions())
    piped = compile_world(bucket, direction, CompileOptions(pipeline=True))  # + check_world
    for b, p in zip(base, piped):
        assert p.graph == b.graph  # same tasks, events and regions: only the order changes
        for (name, q_base), (name2, q_pipe) in zip(b.schedule.queues, p.schedule.queues):
            assert name == name2 and sorted(q_base) == sorted(q_pipe)
    # a rank compiled alone gets the same order as in the world
    assert compile_plan(bucket, direction, P - 1, CompileOptions(pipeline=True)) == piped[-1]


def test_forward_gmm2_and_combine_start_before_gmm1_ends():
    plan = compile_plan(_bucket(2), "forward", 0, CompileOptions(pipeline=True))
    base = compile_plan(_bucket(2), "forward", 0, CompileOptions())
    for p, pipelined in ((plan, True), (base, False)):
        ops = [p.tasks[u].op for u in p.queue("matrix")]
        last_gmm1 = max(i for i, op in enumerate(ops) if op == "gmm1")
        first_gmm2 = ops.index("gmm2")
        assert (first_gmm2 < last_gmm1) == pipelined
        vec = [p.tasks[u].op for u in p.queue("vector")]
        first_combine = vec.index("combine")
        last_act = max(i for i, op in enumerate(vec) if op == "act")
        assert (first_combine < last_act) == pipelined


def test_option_round_trips_and_changes_the_world(tmp_path):
    opts = CompileOptions(pipeline=True)
    plan = compile_plan(_bucket(2), "backward", 1, opts)
    again = load_plan(save_plan(plan, tmp_path / "p.json"))
    assert again.options.pipeline and again.schedule == plan.schedule
    other = compile_plan(_bucket(2), "backward", 0, CompileOptions())
    with pytest.raises(ValueError, match="pipeline"):
        check_world([other, plan])
    with pytest.raises(ValueError, match="pipeline"):
        CompileOptions(pipeline="yes")  # type: ignore[arg-type]
