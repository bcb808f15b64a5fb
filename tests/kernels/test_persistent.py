"""The persistent taskflow kernel (``kernels.persistent``) on lowered plans
(``taskflow.lower``), EP 1, under Triton's interpreter (tests/kernels/conftest.py); EP > 1 on
virtual ranks is test_persistent_world.py:

* plan level: every output and gradient of the forward and backward kernels equals the
  sequential executor's (the Python handlers), at odd shapes with tiles smaller than a slot,
  an empty expert and capacity drops, fp32 and bf16 (the close rule of conftest.py against the
  same executor in float64);
* layer level: ``dispatcher="taskflow", kernels="triton"`` gives the output and every
  gradient (input, router, expert weights) of ``dropless`` and of the Python static executor;
* the tables: thresholds reachable, the topological order never waits on a later producer;
  each broken table is refused by name; the kernel's programs take the rows in that order
  (one program or several) and a wait that cannot be met stops them with the row named.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from _layer_case import assert_runs_close, odd_layer_case, reference_run, run_layer

from moesaic.comm.collectives import EPGroup
from moesaic.kernels import task_ops as ops
from moesaic.routing import build_plan
from moesaic.taskflow import CompileOptions, ShapeBucket, compile_plan, slot_rows_for
from moesaic.taskflow.lower import TableError, check_tables, lower
from moesaic.taskflow.runtime import run_backward, run_forward

pytest.importorskip("triton")

# T = 11, H = 20, F = 18, E = 5, K = 2: odd sizes; tile 4 rows, so slots hold several tiles
T, H, F, E, K, TILE = 11, 20, 18, 5, 2, 4


def _routing(capacity: int | None):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=g)
    logits[:, 2] = -math.inf  # expert 2 gets no row: its tiles run empty and still signal
    w, ids = logits.softmax(-1).topk(K)
    return build_plan(ids, w, E, capacity=capacity)


# compile options per case: (forward, backward)
OPTIONS = {
    "kernel_order": (CompileOptions(), CompileOptions()),
    "pipeline": (CompileOptions(pipeline=True), CompileOptions(pipeline=True)),
    # one task over every slot (a row task in several device rows) and a weight-gradient task
    # over every expert (one device row per expert)
    "unsplit": (
        CompileOptions(unsplit=("gmm1",)),
        CompileOptions(unsplit=("gmm_act_grad", "gmm_w1_grad")),
    ),
}


def _plans(routing, options: str = "kernel_order"):
    load = int(routing.counts_E.max())
    bucket = ShapeBucket(
        tokens=T,
        hidden=H,
        ffn=F,
        experts=E,
        top_k=K,
        ep_size=1,
        slot_rows=slot_rows_for(load, TILE),
        tile_m=TILE,
    )
    fwd, bwd = OPTIONS[options]
    return compile_plan(bucket, "forward", 0, fwd), compile_plan(bucket, "backward", 0, bwd)


def _runtime():
    from moesaic.taskflow.runtime.persistent import PersistentRuntime

    return PersistentRuntime(EPGroup(None, 60.0), tile_m=TILE)


def _step(run_f, run_b, dtype, routing, fwd, bwd, ins):
    x, dy, w1, w2, w3 = (t.to(dtype) for t in ins)
    out = run_f(fwd, x, routing, w1, w2, w3)
    g = run_b(bwd, dy, routing, out.saved, w1, w2, w3)
    return {
        "y": out.y_TH,
        "dx": g.dx_TH,
        "dtopk": g.dtopk_weights_TK,
        "dw1": g.dw1_eHF,
        "dw3": g.dw3_eHF,
        "dw2": g.dw2_eFH,
    }


@pytest.mark.parametrize(
    ("dtype", "capacity", "options"),
    [
        (torch.float32, None, "kernel_order"),
        (torch.float32, 2, "pipeline"),
        (torch.bfloat16, None, "unsplit"),
    ],
)
def test_kernels_match_python_executor(dtype, capacity, options, close):
    routing = _routing(capacity)
    if capacity is not None:
        assert not bool(routing.kept_TK.all()), "the case must drop choices"
    assert int(routing.counts_E[2]) == 0
    fwd, bwd = _plans(routing, options)
    g = torch.Generator().manual_seed(4)
    ins = [torch.randn(*s, generator=g) for s in ((T, H), (T, H), (E, H, F), (E, F, H))]
    ins.append(torch.randn(E, H, F, generator=g))
    ins = [t.to(dtype) for t in ins]  # every path sees the same rounded inputs
    rt = _runtime()
    fast = _step(rt.forward, rt.backward, dtype, routing, fwd, bwd, ins)
    ref = _step(run_forward, run_backward, dtype, routing, fwd, bwd, ins)
    ref64 = _step(run_forward, run_backward, torch.float64, routing, fwd, bwd, ins)
    for name, value in fast.items():
        close(value, ref[name], ref64[name].to(value.dtype), name)
    assert torch.count_nonzero(fast["dw1"][2]) == 0  # the empty expert's gradient


CASES = [
    ({}, False),  # dropless SwiGLU
    ({}, True),  # every token to experts 0 and 1: three empty experts
    ({"capacity_factor": 0.5}, False),  # capacity drops
]


@pytest.mark.parametrize(("extra", "skew"), CASES)
def test_layer_matches_dropless_and_static_executor(extra, skew, monkeypatch):
    from moesaic.kernels import persistent

    launches = []
    real = persistent.start_tables
    monkeypatch.setattr(
        persistent, "start_tables", lambda x, **k: launches.append(x.direction) or real(x, **k)
    )
    cfg, sd, x, g = odd_layer_case(extra, skew)
    fast = run_layer(dataclasses.replace(cfg, dispatcher="taskflow", kernels="triton"), sd, x, g)
    assert launches == ["forward", "backward"]  # one persistent kernel per direction
    static = run_layer(dataclasses.replace(cfg, dispatcher="taskflow"), sd, x, g)
    dropless = run_layer(dataclasses.replace(cfg, dispatcher="dropless"), sd, x, g)
    assert launches == ["forward", "backward"]
    ref = reference_run(cfg, sd, x, g)
    for other in (static, dropless):
        assert_runs_close(fast, other, ref)


def test_runtime_steps_count_on_without_zeroing():
    """Three forward steps of the runtime on one plan: the second launch runs on the other
    counter set, the third on the first set at epoch 2, none zeroed; each step gives the same
    numbers (the same inputs) and the sets hold their uses times the thresholds. (Backward
    launches count on the same way: test_persistent_world.py.)"""
    routing = _routing(None)
    fwd, _ = _plans(routing)
    g = torch.Generator().manual_seed(4)
    x, w1, w2, w3 = (
        torch.randn(*s, generator=g) for s in ((T, H), (E, H, F), (E, F, H), (E, H, F))
    )
    rt = _runtime()
    ys = [rt.forward(fwd, x, routing, w1, w2, w3, save=False).y_TH for _ in range(3)]
    assert ys[0].abs().sum() > 0
    for y in ys[1:]:
        assert torch.equal(y, ys[0])
    signals = rt.peers(fwd, x).signals
    assert signals.launches == 3
    thr = lower(fwd).thresholds
    assert torch.equal(signals.counters[:, : thr.numel()], torch.stack([2 * thr, thr]))


def _simulate(tables, rows):
    """Counts after running ``rows`` (table row indices) in order; fails on a blocked wait."""
    count = [0] * tables.thresholds.numel()
    tasks, trig = tables.tasks.tolist(), tables.triggers.tolist()
    for i in rows:
        r = tasks[i]
        if r[ops.WAIT] >= 0:
            assert count[r[ops.WAIT]] >= r[ops.THRESH], f"row {i} waits before its producers"
        for ev in trig[r[ops.TRIG0] : r[ops.TRIG0] + r[ops.NTRIG]]:
            count[ev] += 1
    return count


@pytest.mark.parametrize("options", list(OPTIONS))
def test_topological_order_never_blocks(options):
    routing = _routing(None)
    for plan in _plans(routing, options):
        tables = lower(plan)
        order = tables.order.tolist()
        # unsplit tasks span several slots or experts: several rows each
        assert (len(order) > len(plan.tasks)) == (options == "unsplit")
        # it runs every row once and reaches every threshold
        assert sorted(order) == list(range(tables.tasks.shape[0]))
        assert _simulate(tables, order) == tables.thresholds.tolist()
        # each queue keeps its compiled (for pipeline: listsched's) order inside it
        starts = tables.queue_starts.tolist()
        for q, name in enumerate(tables.queue_names):
            mine = [i for i in order if starts[q] <= i < starts[q + 1]]
            assert mine == list(range(starts[q], starts[q + 1]))
            uids = tables.tasks[starts[q] : starts[q + 1], ops.UID].tolist()
            assert list(dict.fromkeys(uids)) == list(plan.queue(name))
        # what a launch takes is that order
        assert torch.equal(tables.launch_rows(), tables.tasks[tables.order])
        # every row of a task waits and bumps (on a GPU its rows may run at once): an event's
        # threshold counts its producers' rows
        for uid in set(tables.tasks[:, ops.UID].tolist()):
            mine = tables.tasks[tables.tasks[:, ops.UID] == uid]
            cols = [ops.WAIT, ops.THRESH, ops.TRIG0, ops.NTRIG]
            assert (mine[:, cols] == mine[0, cols]).all(), uid
            assert int(mine[0, ops.NTRIG]) == len(plan.tasks[uid].trigger_events)


def test_broken_tables_are_refused():
    _, bwd = _plans(_routing(None))
    tables = lower(bwd)
    ev = int(tables.tasks[tables.tasks[:, ops.WAIT] >= 0][0, ops.WAIT])
    thr = tables.thresholds.clone()
    thr[ev] += 1
    fixed = tables.tasks.clone()
    fixed[fixed[:, ops.WAIT] == ev, ops.THRESH] += 1
    with pytest.raises(TableError, match=rf"event {ev}: threshold \d+ is unreachable: the tasks"):
        check_tables(dataclasses.replace(tables, thresholds=thr, tasks=fixed))
    with pytest.raises(TableError, match=r"THRESH \d+ must equal event \d+'s threshold"):
        check_tables(dataclasses.replace(tables, thresholds=thr))
    bad = tables.tasks.clone()
    bad[0, ops.OP] = ops.OPCODES["gmm_gate_up"]  # a forward opcode in a backward table
    with pytest.raises(TableError, match="task row 0: opcode 2 is not a backward op"):
        check_tables(dataclasses.replace(tables, tasks=bad))
    with pytest.raises(
        TableError, match=r"single-program order: position \d+ .* waits on event \d+ at 0/"
    ):
        check_tables(dataclasses.replace(tables, order=tables.order.flip(0)))
    unwaited = tables.tasks.clone()
    waits = unwaited[:, ops.WAIT].tolist()
    lone = next(w for w in waits if w >= 0 and waits.count(w) == 1)
    unwaited[waits.index(lone), ops.WAIT : ops.THRESH + 1] = torch.tensor([-1, 0])
    with pytest.raises(TableError, match=rf"event {lone}: no row waits on it"):
        check_tables(dataclasses.replace(tables, tasks=unwaited))
    peer = tables.tasks.clone()
    peer[0, ops.PEER] = 1  # a put to a rank the world does not have
    with pytest.raises(TableError, match=r"task row 0: PEER 1 must be in \[0, 1\)"):
        check_tables(dataclasses.replace(tables, tasks=peer))


def _launch(plan, tables, tasks, programs=None):
    """``run_tables`` on random inputs and ``plan``'s routing (the runtime's step, by hand)."""
    from moesaic.kernels.persistent import run_tables
    from moesaic.taskflow.lower import step_tables
    from moesaic.taskflow.runtime.persistent import rank_launch
    from moesaic.taskflow.runtime.sequential import make_buffers, step_routing

    routing = _routing(None)
    g = torch.Generator().manual_seed(5)
    specs = [b for b in plan.buffers if b.kind == "input"]
    inputs = {b.name: torch.randn(b.rows, b.cols, generator=g) for b in specs}
    bufs = make_buffers(plan, inputs, inputs[specs[0].name])
    step = step_tables(tables, step_routing(plan, routing, EPGroup(None, 60.0)), "cpu")
    launch = rank_launch(
        tables, step, bufs, tokens=T, counters=tables.counters(), psig=[0], pdata=[0]
    )
    return run_tables(dataclasses.replace(launch, tasks=tasks), programs=programs, trace=True)


def test_launch_tables_off_the_buffers_device_are_refused():
    """A table left on another device than the buffers (the kernel would read a host pointer
    on a GPU) is refused by name before the launch."""
    fwd, _ = _plans(_routing(None))
    tables = lower(fwd)
    with pytest.raises(ValueError, match="tasks is on meta; the buffers are on cpu"):
        _launch(fwd, tables, tables.launch_rows().to("meta"))


@pytest.mark.parametrize("programs", [1, 3])
def test_kernel_runs_the_topological_order(programs):
    """Programs take rows by ticket: under the interpreter (programs in turn) the first takes
    every row in the table's order, the others find the queue drained."""
    _, bwd = _plans(_routing(None), "pipeline")
    tables = lower(bwd)
    done = _launch(bwd, tables, tables.launch_rows(), programs)
    # every row once, in the table's order, which is the checked topological order
    assert done == list(range(tables.tasks.shape[0]))
    _simulate(tables, tables.order[done].tolist())


@pytest.mark.timeout(60)
def test_kernel_stops_at_a_wait_that_cannot_be_met():
    fwd, _ = _plans(_routing(None))
    tables = lower(fwd)
    # the queues one after the other: the matrix queue's first tile waits on a dispatch tile
    # of the vector queue, so the program records it and every program stops (no hang)
    from moesaic.kernels.persistent import TaskError

    with pytest.raises(
        TaskError,
        match=r"program 0 gave up at task row 0 \(rank slot 0, .* waiting on event \d+ at 0/1",
    ):
        _launch(fwd, tables, tables.tasks, programs=2)


def test_unsupported_plans_are_refused():
    from moesaic.taskflow.runtime.persistent import PersistentRuntime, check_peers

    class Two:
        size = 2

    # puts store into peer GPUs: a group of CPU tensors is refused before anything starts
    assert "store into peer GPUs' memory; the tensors are on cpu" in str(
        check_peers(Two(), torch.device("cpu"))  # type: ignore[arg-type]
    )
    with pytest.raises(ValueError, match=r"SwiGLU experts only \(got activation 'gelu'\)"):
        PersistentRuntime(EPGroup(None, 60.0), activation="gelu")
    bucket = ShapeBucket(
        tokens=T, hidden=H, ffn=F, experts=E, top_k=K, ep_size=1, slot_rows=8, tile_m=TILE
    )
    gelu = dataclasses.replace(bucket, activation="gelu")
    with pytest.raises(TableError, match="activation 'gelu' has no device opcode"):
        lower(compile_plan(gelu, "forward", 0))


_COMPILE = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import torch
from moesaic.kernels import persistent as pk

INTS = {"tasks", "ticket", "err", "trace", "trig", "trank", "cnt", "count", "tok", "ret"}
# bf16 backward across devices and fp32 forward on one device (its IEEE tl.dot path): both
# directions, both tl.dot paths and both scopes of the release atomics. Both at the
# interpreter's tiles: the CUDA tiles compile the same code at about three times the CPU time
# (~50 s a direction), which the suite's budget cannot carry; tests/gpu compiles them.
TILES = pk.device_tiles(torch.device("cpu"))
for fdt, forward, scope, (BM, BN, BK) in (
    ("bf16", False, "sys", TILES),
    ("fp32", True, "gpu", TILES),
):
    sig = {}
    for name in pk._kernel.arg_names:
        if name in ("BM", "BN", "BK", "UPCAST", "TRACE", "SCOPE", "FORWARD"):
            sig[name] = "constexpr"
        elif not name.endswith("_ptr"):
            sig[name] = "i32"
        elif name[:-4] in INTS:
            sig[name] = "*i32"
        elif name[:-4] in ("psig", "pdata"):
            sig[name] = "*i64"
        else:
            sig[name] = "*fp32" if name[:-4] in ("wt", "wtk") else "*" + fdt
    consts = dict(BM=BM, BN=BN, BK=BK, UPCAST=False, TRACE=False, SCOPE=scope, FORWARD=forward)
    src = ASTSource(fn=pk._kernel, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    ops = set(re.findall(r"(?:ld|red|atom)[.a-z]*\\.(?:acquire|release)[.a-z0-9]*", ptx))
    print(fdt, scope, sorted(ops))
"""


def test_kernels_compile_for_a_gpu(tmp_path):
    """The kernel compiles for an H100 (sm_90, down to a cubin; bf16 backward across devices
    and fp32 forward on one device, at the interpreter's tiles), with the counters read by acquire loads
    and bumped by release reductions at the launch's scope ("gpu": virtual ranks on one
    device; "sys": real peers, whose bumps cross NVLink)."""
    import subprocess
    import sys

    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("Triton's CUDA backend is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    for fdt, scope in (("bf16", "sys"), ("fp32", "gpu")):
        acq_rel = f"['ld.global.{scope}.acquire.b32', 'red.global.{scope}.release.add.u32']"
        assert f"{fdt} {scope} {acq_rel}" in lines, out.stdout


def test_taskflow_selects_the_kernel_on_cuda_and_the_host_runtime_on_cpu():
    """``kernels="auto"`` (the default): the persistent kernel for CUDA tensors, the host
    runtime for CPU ones (so the default CPU layer is the host runtime's, as before);
    ``"triton"``: the kernel for every step; ``"torch"``: the host runtime only."""
    import moesaic
    from moesaic.taskflow.runtime.concurrent import TaskflowRuntime
    from moesaic.taskflow.runtime.persistent import PersistentRuntime

    cfg = moesaic.MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=2, dispatcher="taskflow")
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    auto = moesaic.MoELayer(cfg).strategy.runtime
    assert isinstance(auto, PersistentRuntime)
    assert auto.uses_kernel(cuda) and not auto.uses_kernel(cpu)
    triton = moesaic.MoELayer(dataclasses.replace(cfg, kernels="triton")).strategy.runtime
    assert isinstance(triton, PersistentRuntime) and triton.uses_kernel(cpu)
    host = moesaic.MoELayer(dataclasses.replace(cfg, kernels="torch")).strategy.runtime
    assert type(host) is TaskflowRuntime
    gelu = dataclasses.replace(cfg, activation="gelu")
    assert type(moesaic.MoELayer(gelu).strategy.runtime) is TaskflowRuntime
