"""Operator dependency graph, split propagation (Alg. 1) and the MoE-FFN graphs."""

from __future__ import annotations

import pytest

from moesaic.taskflow import (
    CompileOptions,
    GraphCycleError,
    GraphError,
    OperatorGraph,
    OperatorNode,
    ShapeBucket,
    SplitSpec,
    backward_graph,
    compile_plan,
    forward_graph,
    propagate_splits,
)
from moesaic.taskflow.moe_graphs import TASK_TYPES


def _op(name, inputs, outputs, split_inputs, out_dims, n):
    spec = SplitSpec(
        split_inputs=split_inputs, split_output_dims=out_dims, task_num_fn=lambda c, n=n: n
    )
    return OperatorNode(name=name, op_type=name, inputs=inputs, outputs=outputs, split=spec)


def _chain(first_n: int, second_dim: int = 0) -> OperatorGraph:
    """src -(x, split dim 0)-> mid -(y)-> last, plus a metadata tensor ``meta``."""
    g = OperatorGraph("chain")
    for t in ("in", "meta", "x", "y", "z"):
        g.add_tensor(t, 2)
    g.add_op(_op("src", ("in",), ("x",), None, (0,), first_n))
    g.add_op(_op("mid", ("x", "meta"), ("y",), ((0, second_dim),), (0,), 4))
    g.add_op(_op("last", ("y",), ("z",), ((0, 0),), (-1,), 4))
    return g


def test_split_propagates_along_the_chain():
    res = propagate_splits(_chain(8), config=None)
    assert res.order == ("src", "mid", "last")
    assert res.task_num == {"src": 8, "mid": 4, "last": 4}
    assert (res.labels["x"].dim, res.labels["x"].num) == (0, 8)
    assert (res.labels["y"].dim, res.labels["y"].num) == (0, 4)
    # Alg. 1 line 22: split into 4 tasks but the output does not carry the partition on.
    assert (res.labels["z"].dim, res.labels["z"].num) == (-1, 4)
    # "meta" is not in split_inputs: unlabelled metadata never blocks the split.
    assert res.labels["meta"].dim == -1
    assert res.fell_back == ()


def test_fallback_when_upstream_is_unsplit():
    # src yields one task, so x stays unlabelled and every inheriting op falls back to one task.
    res = propagate_splits(_chain(1), config=None)
    assert res.task_num == {"src": 1, "mid": 1, "last": 1}
    assert res.fell_back == ("mid", "last")
    assert res.labels["y"].dim == -1


def test_fallback_when_the_split_dimension_differs():
    res = propagate_splits(_chain(8, second_dim=1), config=None)
    assert res.task_num == {"src": 8, "mid": 1, "last": 1}
    assert res.fell_back == ("mid", "last")


def test_forced_unsplit_falls_back_downstream():
    res = propagate_splits(_chain(8), config=None, unsplit=("mid",))
    assert res.task_num == {"src": 8, "mid": 1, "last": 1}
    assert res.fell_back == ("last",)  # "mid" was forced, "last" fell back per Alg. 1


def test_cycle_is_rejected_with_its_path():
    g = OperatorGraph("loop")
    for t in ("a", "b", "c"):
        g.add_tensor(t, 2)
    g.add_op(_op("p", ("c",), ("a",), None, (0,), 2))
    g.add_op(_op("q", ("a",), ("b",), ((0, 0),), (0,), 2))
    g.add_op(_op("r", ("b",), ("c",), ((0, 0),), (0,), 2))
    with pytest.raises(GraphCycleError, match=r"cycle: p -> q -> r -> p"):
        propagate_splits(g, config=None)
    assert issubclass(GraphCycleError, ValueError)


@pytest.mark.parametrize(
    "build, match",
    [
        # a tensor with two producers
        (lambda g: [g.add_op(_op("a", ("in",), ("x",), None, (0,), 2)),
                    g.add_op(_op("b", ("in",), ("x",), None, (0,), 2))], "already produced"),
        # an undeclared tensor
        (lambda g: g.add_op(_op("a", ("nope",), ("x",), None, (0,), 2)), "undeclared"),
        # split_inputs names an input that does not exist
        (lambda g: g.add_op(_op("a", ("in",), ("x",), ((3, 0),), (0,), 2)), "names input 3"),
        # an output split dim beyond the tensor's rank
        (lambda g: g.add_op(_op("a", ("in",), ("x",), None, (5,), 2)), "out of range"),
        # an operator added twice
        (lambda g: [g.add_op(_op("a", ("in",), ("x",), None, (0,), 2)),
                    g.add_op(_op("a", ("in",), ("in",), None, (0,), 2))], "added twice"),
    ],
)  # fmt: skip
def test_malformed_graphs_name_the_problem(build, match):
    g = OperatorGraph("bad")
    g.add_tensor("in", 2)
    g.add_tensor("x", 2)
    with pytest.raises(GraphError, match=match):
        build(g)


def test_task_num_fn_must_return_a_positive_int():
    g = OperatorGraph("zero")
    g.add_tensor("in", 2)
    g.add_tensor("x", 2)
    g.add_op(_op("a", ("in",), ("x",), None, (0,), 0))
    with pytest.raises(GraphError, match="must be an int >= 1"):
        propagate_splits(g, config=None)


BUCKET = ShapeBucket(
    tokens=10, hidden=8, ffn=6, experts=4, top_k=2, ep_size=2, slot_rows=8, tile_m=2,
    gmm_tile_m=4,
)  # fmt: skip


def test_forward_graph_nodes_and_counts():
    g = forward_graph().graph
    assert [op.name for op in g.topological_order()] == [
        "dispatch", "gmm1", "act", "gmm2", "combine", "reduce"
    ]  # fmt: skip
    res = propagate_splits(g, BUCKET)
    # R = e*P*S = 2*2*8 = 32 receive rows: 16 dispatch tiles of 2 rows, 8 GMM tiles of 4 rows;
    # reduce: ceil(10 / 2) = 5 token tiles.
    assert res.task_num == {
        "dispatch": 16, "gmm1": 8, "act": 8, "gmm2": 8, "combine": 8, "reduce": 5
    }  # fmt: skip
    # The graph carries no queue; the task-type table gives each type's queue class.
    assert {op.name: TASK_TYPES[op.op_type].queue_class for op in g.ops.values()} == {
        "dispatch": "vector", "gmm1": "matrix", "act": "vector", "gmm2": "matrix",
        "combine": "vector", "reduce": "vector",
    }  # fmt: skip


def test_backward_graph_has_the_seven_nodes_of_fig_2b():
    g = backward_graph().graph
    seven = {"dispatch_bwd", "gmm_act_grad", "gmm_w2_grad", "act_grad", "gmm_gate_grad",
             "combine_bwd", "gmm_w1_grad"}  # fmt: skip
    assert seven <= set(g.ops)
    # Both GMMs after backward Dispatch consume its output independently; likewise after the
    # SwiGLU gradient.
    assert g.predecessors("gmm_act_grad") == ["dispatch_bwd"]
    assert g.predecessors("gmm_w2_grad") == ["dispatch_bwd"]
    assert g.predecessors("gmm_gate_grad") == ["act_grad"]
    assert g.predecessors("gmm_w1_grad") == ["act_grad"]
    res = propagate_splits(g, BUCKET)
    assert res.task_num["gmm_w2_grad"] == res.task_num["gmm_w1_grad"] == 2  # one per expert


def test_unsplit_gmm1_makes_its_row_consumers_fall_back():
    plan = compile_plan(BUCKET, "forward", 0, CompileOptions(unsplit=("gmm1",)))
    assert plan.fell_back == ("act", "gmm2", "combine")
    assert plan.task_num["dispatch"] == 16 and plan.task_num["reduce"] == 5


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_gmm_tasks_never_split_the_reduction_dimension(direction):
    plan = compile_plan(BUCKET, direction, 1)
    H, F, e, P, S = 8, 6, 2, 2, 8
    for t in plan.tasks:
        if TASK_TYPES[t.task_type].queue_class != "matrix":
            continue
        j = t.expert - plan.rank * e
        if t.task_type in ("gmm_w1_grad", "gmm_w2_grad"):
            # Weight gradients reduce over rows: one task reads every row of its expert.
            assert all((r.start, r.stop) == (j * P * S, (j + 1) * P * S) for r in t.inputs)
        else:
            # Row GMMs read a full weight block (all of H or F) of their expert.
            for r in t.inputs[1:]:
                per = H if r.buffer in ("w1", "w3") else F
                assert (r.start, r.stop) == (j * per, (j + 1) * per)


def test_communication_tiles_align_with_gmm_row_tiles():
    plan = compile_plan(BUCKET, "forward", 0)
    by_op = {}
    for t in plan.tasks:
        by_op.setdefault(t.op, []).append(t)
    gmm_rows = [(t.inputs[0].start, t.inputs[0].stop) for t in by_op["gmm1"]]
    # Every dispatch tile written on this rank (local or remote) lies inside one GMM1 tile.
    written = [(r.start, r.stop) for t in by_op["dispatch"] for r in t.outputs if r.rank == 0]
    written += [(r.start, r.stop) for w in plan.remote_writes for r in w.regions
                if r.buffer == "x_recv"]  # fmt: skip
    for a, z in written:
        assert sum(ga <= a and z <= gz for ga, gz in gmm_rows) == 1
    # Combine tiles are exactly the GMM2 output tiles.
    assert [t.inputs[0] for t in by_op["combine"]] == [t.outputs[0] for t in by_op["gmm2"]]
