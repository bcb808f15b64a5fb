"""The taskized SwiGLU+Add microbenchmark (``benchmarks/taskflow_microbench.py``): its graphs compute
``silu(x1) * x2 + r`` under both schedules and both executors, run every task once, in the
order the schedule claims (static), and refuse bad parameters naming them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _scripts import load_benchmark
from moesaic.trace import Recorder

microbench = load_benchmark("taskflow_microbench")
ORDERS = microbench.ORDERS
SwigluAddShape = microbench.SwigluAddShape
chain_graph = microbench.chain_graph
make_buffers = microbench.make_buffers
make_launch = microbench.make_launch
noop_launch = microbench.noop_launch
order_distance = microbench.order_distance
reference = microbench.reference
run_graph = microbench.run_graph
run_untiled = microbench.run_untiled
swiglu_add_graph = microbench.swiglu_add_graph
swiglu_add_schedule = microbench.swiglu_add_schedule

RUNS = [("static", 1), ("dynamic", 1), ("dynamic", 2)]
SHAPES = [
    SwigluAddShape(rows=100, tile_m=7, h_in=24, h_out=12),  # partial last tile, H not 2^k
    SwigluAddShape(rows=5, tile_m=1, h_in=8, h_out=4),  # one row per task
    SwigluAddShape(rows=3, tile_m=64, h_in=8, h_out=4),  # one tile larger than M
]


class Recording:
    """A launch that notes each uid, then runs the real one."""

    def __init__(self, launch):
        self.launch, self.uids = launch, []

    def __call__(self, task):
        self.uids.append(task.uid)
        self.launch(task)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("executor", "processors"), RUNS)
def test_output_and_every_task_once(shape, order, executor, processors):
    graph = swiglu_add_graph(shape)
    bufs = make_buffers(shape, seed=3)
    x1, x2 = bufs.x_MHi[:, : shape.h_out], bufs.x_MHi[:, shape.h_out :]
    # fp32 against the plain-torch formula: silu into s then an in-place multiply is the same
    # arithmetic as F.silu(x1) * x2, so only a rounding-level difference is allowed
    expected = F.silu(x1.double()) * x2.double() + bufs.r_MHo.double()
    rec = Recording(make_launch(graph, bufs))
    run_graph(executor, graph, swiglu_add_schedule(graph, order), rec, processors=processors,
              timeout_s=10)  # fmt: skip
    torch.testing.assert_close(bufs.out_MHo.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bufs.out_MHo, reference(bufs), rtol=0, atol=0)
    out = bufs.out_MHo.clone()
    run_untiled(bufs)  # the same kernels over whole tensors: equal bits
    assert torch.equal(out, bufs.out_MHo)
    assert sorted(rec.uids) == list(range(2 * shape.tiles))
    for i in range(shape.tiles):  # an Add tile never before its SwiGLU tile
        assert rec.uids.index(2 * i) < rec.uids.index(2 * i + 1)


def test_static_runs_the_claimed_orders():
    shape = SwigluAddShape(rows=40, tile_m=8, h_in=8, h_out=4)
    graph = swiglu_add_graph(shape)
    serial, inter = (swiglu_add_schedule(graph, o) for o in ("serial", "interleaved"))
    assert serial.queue("matrix") == inter.queue("matrix") == ()
    assert serial.queue("vector") == (0, 2, 4, 6, 8, 1, 3, 5, 7, 9)
    assert inter.queue("vector") == tuple(range(10))
    for sched, distance in ((serial, 5.0), (inter, 1.0)):
        rec = Recording(noop_launch)
        run_graph("static", graph, sched, rec, timeout_s=10)
        assert tuple(rec.uids) == sched.queue("vector")
        assert order_distance(rec.uids) == distance


def test_graph_structure():
    shape = SwigluAddShape(rows=10, tile_m=4, h_in=8, h_out=4)
    graph = swiglu_add_graph(shape)
    assert shape.tiles == 3 and len(graph.tasks) == 6 and len(graph.events) == 3
    assert dict(graph.task_num) == {"swiglu": 3, "add": 3}
    for i in range(3):
        s, a = graph.tasks[2 * i], graph.tasks[2 * i + 1]
        assert (s.uid, a.uid) == (2 * i, 2 * i + 1)
        assert [e.event for e in s.trigger_events] == [i] and s.dependent_event == -1
        assert a.dependent_event == i and a.trigger_events == ()
        assert graph.events[i].threshold == 1
        rows = (s.outputs[0].start, s.outputs[0].stop)
        assert rows == shape.tile_rows(i) == (a.outputs[0].start, a.outputs[0].stop)
        assert [r.buffer for r in (*s.inputs, *s.outputs)] == ["x", "s"]
        assert [r.buffer for r in (*a.inputs, *a.outputs)] == ["s", "r", "out"]
    assert shape.tile_rows(2) == (8, 10)
    assert shape.working_set_bytes() == 10 * (8 + 3 * 4) * 4


@pytest.mark.parametrize("executor", ["static", "dynamic"])
def test_chain_and_trace_lanes(executor):
    graph, sched = chain_graph(30)
    rec, recorder = Recording(noop_launch), Recorder(0)
    run_graph(executor, graph, sched, rec, processors=2, timeout_s=10, recorder=recorder)
    assert rec.uids == list(range(30))  # a chain has one legal order
    lanes = {s.resource for s in recorder.events}
    assert len(recorder.events) == 30
    if executor == "static":
        assert lanes == {"vector"}
    else:
        assert lanes and lanes <= {"processor0", "processor1"}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"rows": 0, "tile_m": 1}, "rows"),
        ({"rows": 4, "tile_m": 0}, "tile_m"),
        ({"rows": True, "tile_m": 1}, "rows"),  # a bool is not a size
        ({"rows": 4, "tile_m": 2, "h_in": 8, "h_out": 0}, "h_out"),
        ({"rows": 4, "tile_m": 2, "h_in": 10, "h_out": 4}, "h_in"),
        ({"rows": 4, "tile_m": 2.0}, "tile_m"),
    ],
)
def test_bad_shape_names_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SwigluAddShape(**kwargs)


def test_bad_arguments_name_the_parameter():
    shape = SwigluAddShape(rows=8, tile_m=4, h_in=8, h_out=4)
    graph = swiglu_add_graph(shape)
    sched = swiglu_add_schedule(graph, "serial")
    with pytest.raises(ValueError, match=r"^order"):
        swiglu_add_schedule(graph, "random")
    with pytest.raises(ValueError, match=r"^executor"):
        run_graph("eager", graph, sched, noop_launch)
    with pytest.raises(ValueError, match=r"^processors"):
        run_graph("dynamic", graph, sched, noop_launch, processors=0)
    with pytest.raises(ValueError, match=r"^tasks"):
        chain_graph(0)
    with pytest.raises(ValueError, match=r"^buffer x"):
        make_launch(graph, make_buffers(SwigluAddShape(rows=9, tile_m=4, h_in=8, h_out=4)))
    with pytest.raises(ValueError, match=r"^uids"):
        order_distance([0, 0, 1, 2])
