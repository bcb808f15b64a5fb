"""Virtual ranks: the forward and backward plans of every rank of a world of V = 2 and 4 in
one launch of the persistent kernel (``taskflow.runtime.persistent.run_virtual``) under
Triton's interpreter, against ``moesaic.reference``: the outputs, the input and routing-weight
gradients of every rank's tokens and the weight gradients of every rank's experts.

Dispatch tiles are stored straight into the peer's receive slots and signalled there by a
release atomic, expert tiles start on an acquire read of that signal, the combine puts back
the same way: the same kernel code real peers run (only the offset tables differ).

Tolerance: ``close`` (conftest.py): the kernel accumulates each GEMM tile in fp32 over k in
tiles of 32 (``tl.dot``) and the weight gradients slot by slot, torch in its own blocked
order, so the two fp32 results differ by summation order only; the rule bounds the kernel's
error against the float64 reference by twice torch's own fp32 error plus 4 ulps of the
tensor's scale, and no looser bound is used.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _world_case import F, H, expert_weights, reference, run_case, world_case

from moesaic.kernels import task_ops as ops
from moesaic.taskflow.compile import compile_world
from moesaic.taskflow.lower import lower_world

pytest.importorskip("triton")


@pytest.mark.parametrize(("V", "case"), [(2, "random"), (4, "skewed")])
def test_virtual_ranks_match_reference(V, case, close):
    ranks, bucket = world_case(V, case)
    weights = expert_weights(bucket.experts)
    out, grads = run_case(ranks, bucket, weights)
    ref32, dw32 = reference(ranks, weights, torch.float32)
    ref64, dw64 = reference(ranks, weights, torch.float64)
    counts = sum(r[0].counts_E for r in ranks)
    if case == "random":
        assert int(counts[1]) == 0  # an expert with no token
    else:
        assert int(counts[2:].sum()) == 0  # experts 2.. (at V = 4 two ranks) get nothing
        assert ranks[-1][1].numel() == 0  # a rank with no token
    e = bucket.local_experts
    for r in range(V):
        n = ranks[r][1].shape[0]  # this rank's real tokens
        close(out[r]["y_TH"][:n], ref32[r]["y_TH"], ref64[r]["y_TH"].float(), f"y[{r}]")
        close(grads[r]["dx_TH"][:n], ref32[r]["dx_TH"], ref64[r]["dx_TH"].float(), f"dx[{r}]")
        close(
            grads[r]["dtopk_TK"][:n],
            ref32[r]["dtopk_TK"],
            ref64[r]["dtopk_TK"].float(),
            f"dtopk[{r}]",
        )
        assert not grads[r]["dx_TH"][n:].any()  # padded tokens: no gradient
        for name, shape in (("w1", (e, H, F)), ("w3", (e, H, F)), ("w2", (e, F, H))):
            mine = slice(r * e, (r + 1) * e)
            close(
                grads[r][f"d{name}"].view(shape),
                dw32[name][mine],
                dw64[name][mine].float(),
                f"d{name}[{r}]",
            )


@pytest.mark.timeout(120)
def test_wrong_signal_threshold_is_an_error_naming_the_row():
    """Rank 1's first gate/up tile (it waits on a put from a dispatch tile) made to wait for
    one bump more than its producers give: the program spins a bounded number of re-reads,
    records the row and every program stops: a ``TaskError`` naming the launch row, its rank,
    plan uid and the count it saw, never a hang."""
    from moesaic.kernels.persistent import TaskError
    from moesaic.taskflow.runtime.persistent import run_virtual

    ranks, bucket = world_case(2, "random")
    weights = expert_weights(bucket.experts)
    fwd = compile_world(bucket, "forward")
    world = lower_world(fwd)
    e = bucket.local_experts
    ins = []
    for r in range(2):
        w1, w3, w2 = (w[r * e : (r + 1) * e].reshape(-1, w.shape[-1]) for w in weights)
        ins.append({"x_TH": ranks[r][3], "w1": w1, "w3": w3, "w2": w2})
    tasks = world.ranks[1].tasks.clone()
    i = int((tasks[:, ops.OP] == ops.OPCODES["gmm_gate_up"]).nonzero()[0])
    assert tasks[i, ops.WAIT] >= 0
    tasks[i, ops.THRESH] += 1
    broken = dataclasses.replace(world.ranks[1], tasks=tasks)
    world = dataclasses.replace(world, ranks=(world.ranks[0], broken))
    row = world.order.tolist().index([1, i])  # its position in the launch
    want = tasks[i].tolist()
    with pytest.raises(TaskError) as info:
        run_virtual(world, fwd, ins, [r[0] for r in ranks])
    assert info.value.row == row
    assert (
        f"gave up at task row {row} (rank slot 1, plan uid {want[ops.UID]}, opcode "
        f"{want[ops.OP]}) waiting on event {want[ops.WAIT]} at {want[ops.THRESH] - 1}/"
        f"{want[ops.THRESH]}"
    ) in str(info.value)


def _world_inputs(ranks, bucket, weights, step: int):
    """Every rank's forward inputs of one step: the case's tokens scaled per step (each step
    its own numbers, the case's routing)."""
    e = bucket.local_experts
    ins = []
    for r in range(bucket.ep_size):
        w1, w3, w2 = (w[r * e : (r + 1) * e].reshape(-1, w.shape[-1]) for w in weights)
        ins.append({"x_TH": ranks[r][3] * (1.0 + step), "w1": w1, "w3": w3, "w2": w2})
    return ins


def _counts(signals, world, s):
    """Set ``s``'s counters per rank, cut to each rank's events."""
    V = len(world.ranks)
    per = signals.counters[s].view(V, -1)
    return [per[r, : t.thresholds.numel()] for r, t in enumerate(world.ranks)]


@pytest.mark.timeout(120)
def test_back_to_back_launches_count_on_without_a_reset(close):
    """Three forward and three backward launches of a V = 2 world on the same counters, never
    zeroed (``EpochSignals``: two sets in turn, waits at ``epoch * threshold``), each step's
    outputs and gradients against ``moesaic.reference``; the sets then hold their uses times
    the thresholds (launches 1 and 3 on set 0, 2 on set 1). A launch whose epoch skips one
    (a stale count) is a ``TaskError`` naming its first waiting row and the count it saw, and
    counters past 2**31 (int32 wrap) still meet their waits."""
    from moesaic.kernels.persistent import TaskError
    from moesaic.taskflow.runtime.persistent import run_virtual, virtual_signals
    from moesaic.taskflow.runtime.sequential import SAVED

    ranks, bucket = world_case(2, "random")
    weights = expert_weights(bucket.experts)
    fwd, bwd = compile_world(bucket, "forward"), compile_world(bucket, "backward")
    wf, wb = lower_world(fwd), lower_world(bwd)
    fsig, bsig = virtual_signals(wf), virtual_signals(wb)
    routings = [r[0] for r in ranks]
    for step in range(3):
        ins = _world_inputs(ranks, bucket, weights, step)
        out, _ = run_virtual(wf, fwd, ins, routings, signals=fsig)
        bins = [
            {"dy_TH": ranks[r][4], **{k: ins[r][k] for k in ("w1", "w3", "w2")}}
            | {k: out[r][k] for k in SAVED}
            for r in range(2)
        ]
        grads, _ = run_virtual(wb, bwd, bins, routings, signals=bsig)
        scaled = [(*r[:3], r[3] * (1.0 + step), r[4]) for r in ranks]
        ref32, _ = reference(scaled, weights, torch.float32)
        ref64, _ = reference(scaled, weights, torch.float64)
        for r in range(2):
            n = ranks[r][1].shape[0]
            close(out[r]["y_TH"][:n], ref32[r]["y_TH"], ref64[r]["y_TH"].float(), f"y{step}[{r}]")
            close(grads[r]["dx_TH"][:n], ref32[r]["dx_TH"], ref64[r]["dx_TH"].float(), f"dx{step}")
    for sig, world in ((fsig, wf), (bsig, wb)):
        for s, uses in ((0, 2), (1, 1)):
            for got, t in zip(_counts(sig, world, s), world.ranks):
                assert torch.equal(got, uses * t.thresholds)

    # a stale count: the next forward made to run at epoch 4 on set 0, which holds 2 uses
    fsig.launches = 6
    order = wf.order.tolist()
    first = next(i for i, (r, row) in enumerate(order) if wf.ranks[r].tasks[row, ops.WAIT] >= 0)
    rank, row = order[first]
    thr = int(wf.ranks[rank].tasks[row, ops.THRESH])
    ins = _world_inputs(ranks, bucket, weights, 0)
    with pytest.raises(TaskError) as info:
        run_virtual(wf, fwd, ins, routings, signals=fsig)
    assert info.value.row == first
    assert f"at {3 * thr}/{4 * thr} (epoch 4 x threshold {thr})" in str(info.value)

    # past 2**31: every counter of set 0 as 2**31 - 1 launches left it (wrapped to int32)
    epoch = 2**31
    for t, c in zip(wf.ranks, _counts(fsig, wf, 0)):
        held = [((epoch - 1) * x + 2**31) % 2**32 - 2**31 for x in t.thresholds.tolist()]
        c.copy_(torch.tensor(held, dtype=torch.int32))
    fsig.launches = 2 * (epoch - 1)
    out, _ = run_virtual(wf, fwd, ins, routings, signals=fsig)
    ref32, _ = reference(ranks, weights, torch.float32)
    ref64, _ = reference(ranks, weights, torch.float64)
    for r in range(2):
        n = ranks[r][1].shape[0]
        close(out[r]["y_TH"][:n], ref32[r]["y_TH"], ref64[r]["y_TH"].float(), f"y wrapped[{r}]")


def test_a_rank_deaf_to_another_is_refused():
    """Two counter sets in turn suffice only while every rank's launch waits on every other
    rank's (ranks stay within one launch of each other): tables where rank 1 never bumps rank
    0's events are refused, naming both."""
    from moesaic.taskflow.lower import TableError, check_world_tables

    _, bucket = world_case(2, "random")
    world = lower_world(compile_world(bucket, "forward"))
    one = world.ranks[1]
    deaf = dataclasses.replace(one, trigger_ranks=torch.ones_like(one.trigger_ranks))
    with pytest.raises(TableError, match=r"^rank 0: no row of rank 1 bumps its events"):
        check_world_tables(dataclasses.replace(world, ranks=(world.ranks[0], deaf)))
