"""The persistent taskflow kernels (``kernels.persistent``) on lowered plans
(``taskflow.lower``), EP 1, under Triton's interpreter (tests/kernels/conftest.py):

* plan level: every output and gradient of the forward and backward kernels equals the
  sequential executor's (the Python handlers), at odd shapes with tiles smaller than a slot,
  an empty expert and capacity drops, fp32 and bf16 (the close rule of conftest.py against the
  same executor in float64);
* layer level: ``dispatcher="taskflow", kernels="triton"`` gives the output and every
  gradient (input, router, expert weights) of ``dropless`` and of the Python static executor;
* the tables: thresholds reachable, the single-program order never waits on a later
  producer, the concurrent split is the plan's queues; each broken table is refused by name.
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
    real = persistent.run_tables
    monkeypatch.setattr(
        persistent, "run_tables", lambda d, *a, **k: launches.append(d) or real(d, *a, **k)
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
def test_single_program_order_never_blocks(options):
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
        # what the single program runs is that order
        tasks, cut = tables.program_tables("single_program")
        assert torch.equal(tasks, tables.tasks[tables.order])
        assert cut.tolist() == [0, len(order)]
        # the concurrent split is one program per queue
        tasks, cut = tables.program_tables("concurrent")
        assert cut.tolist() == starts and torch.equal(tasks, tables.tasks)


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
    # the vector queue reversed (its reduce tiles first) while the single-program order runs
    # the same rows as before: runnable by one program, a deadlock for one program per queue
    n, m_end = tables.tasks.shape[0], int(tables.queue_starts[1])
    perm = torch.cat([torch.arange(m_end), torch.arange(m_end, n).flip(0)])
    inv = torch.argsort(perm)
    reversed_vector = dataclasses.replace(tables, tasks=tables.tasks[perm], order=inv[tables.order])
    with pytest.raises(TableError, match="concurrent mode: the queues' programs would deadlock"):
        check_tables(reversed_vector)


def _launch(plan, tables, tasks, starts):
    """``run_tables`` on random inputs and ``plan``'s routing (the runtime's step, by hand)."""
    from moesaic.kernels.persistent import run_tables
    from moesaic.taskflow.lower import step_tables
    from moesaic.taskflow.runtime.sequential import make_buffers, step_routing

    routing = _routing(None)
    g = torch.Generator().manual_seed(5)
    specs = [b for b in plan.buffers if b.kind == "input"]
    inputs = {b.name: torch.randn(b.rows, b.cols, generator=g) for b in specs}
    bufs = make_buffers(plan, inputs, inputs[specs[0].name])
    step = step_tables(tables, step_routing(plan, routing, EPGroup(None, 60.0)), "cpu")
    return run_tables(
        plan.direction,
        tasks,
        starts,
        tables.triggers,
        tables.counters(),
        dataclasses.asdict(step),
        bufs,
        hidden=H,
        ffn=F,
        top_k=K,
        ep_size=1,
        slot_rows=tables.slot_rows,
        trace=True,
    )


def test_kernel_runs_the_single_program_order():
    _, bwd = _plans(_routing(None), "pipeline")
    tables = lower(bwd)
    tasks, starts = tables.program_tables("single_program")
    done = _launch(bwd, tables, tasks, starts)
    # every row once, in the table's order, which is the checked single-program order
    assert done == list(range(tables.tasks.shape[0]))
    _simulate(tables, tables.order[done].tolist())


def test_kernel_refuses_blocking_order_and_concurrent_interpreter():
    fwd, _ = _plans(_routing(None))
    tables = lower(fwd)
    with pytest.raises(ValueError, match="2 concurrent programs cannot run under Triton's int"):
        _launch(fwd, tables, *tables.program_tables("concurrent"))
    # the queues one after the other in one program: the matrix queue's first tile waits on a
    # dispatch tile of the vector queue, so the program records it and stops (no hang)
    starts = torch.tensor([0, tables.tasks.shape[0]], dtype=torch.int32)
    with pytest.raises(
        RuntimeError, match=r"program 0 gave up at task row 0 .* waiting on event \d+ at 0/1"
    ):
        _launch(fwd, tables, tables.tasks, starts)


def test_unsupported_plans_are_refused():
    from moesaic.taskflow.runtime.persistent import PersistentRuntime

    class Two:
        size = 2

    with pytest.raises(ValueError, match=r"runs EP 1 only \(got an expert-parallel group of 2\)"):
        PersistentRuntime(Two())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SwiGLU experts only \(got activation 'gelu'\)"):
        PersistentRuntime(EPGroup(None, 60.0), activation="gelu")
    bucket = ShapeBucket(
        tokens=T, hidden=H, ffn=F, experts=4, top_k=K, ep_size=2, slot_rows=8, tile_m=TILE
    )
    with pytest.raises(TableError, match="ep_size 2; the persistent kernel runs EP 1 only"):
        lower(compile_plan(bucket, "forward", 0))
    gelu = dataclasses.replace(bucket, ep_size=1, experts=E, activation="gelu")
    with pytest.raises(TableError, match="activation 'gelu' has no device opcode"):
        lower(compile_plan(gelu, "forward", 0))


_COMPILE = """
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moesaic.kernels import persistent as pk

INTS = {"tasks", "starts", "trig", "cnt", "status", "trace", "count", "tok", "ret"}
# fp32 forward, bf16 backward: both kernels and both tl.dot paths (IEEE fp32, half tiles)
for fn, fdt in ((pk._forward_kernel, "fp32"), (pk._backward_kernel, "bf16")):
    sig = {}
    for name in fn.arg_names:
        if name in ("BM", "BN", "BK", "UPCAST", "TRACE"):
            sig[name] = "constexpr"
        elif not name.endswith("_ptr"):
            sig[name] = "i32"
        elif name[:-4] in INTS:
            sig[name] = "*i32"
        else:
            sig[name] = "*fp32" if name[:-4] in ("wt", "wtk") else "*" + fdt
    consts = {"BM": pk.BLOCK_M, "BN": pk.BLOCK_N, "BK": pk.BLOCK_K, "UPCAST": False, "TRACE": False}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    ops = set(re.findall(r"(?:ld|red)[.a-z]*\\.(?:acquire|release)[.a-z0-9]*", ptx))
    print(fn.__name__, fdt, sorted(ops))
"""


def test_kernels_compile_for_a_gpu(tmp_path):
    """The concurrent mode's code path cannot run here, but both kernels compile for an H100
    (sm_90, down to a cubin; fp32 forward, bf16 backward), with the counters read by acquire
    loads and bumped by release reductions."""
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
    acq_rel = "['ld.global.gpu.acquire.b32', 'red.global.gpu.release.add.u32']"
    for fn, fdt in (("_forward_kernel", "fp32"), ("_backward_kernel", "bf16")):
        assert f"{fn} {fdt} {acq_rel}" in lines, out.stdout
