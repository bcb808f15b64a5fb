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
