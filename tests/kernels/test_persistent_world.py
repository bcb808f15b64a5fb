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
import math

import pytest
import torch

from moesaic.config import MoEConfig
from moesaic.kernels import task_ops as ops
from moesaic.placement import ExpertPlacement
from moesaic.reference import ReferenceMoE
from moesaic.routing import build_plan
from moesaic.strategies.taskflow import pad_routing
from moesaic.taskflow import ShapeBucket, slot_rows_for
from moesaic.taskflow.compile import compile_world
from moesaic.taskflow.lower import lower_world
from moesaic.taskflow.runtime.sequential import SAVED

pytest.importorskip("triton")

T, H, F, K, TILE = 5, 20, 18, 2, 4


def _world(V: int, case: str, E: int = 4):
    """Per rank: (routing, ids, weights, x, dy); ``case``: "random" (expert 1 gets no token),
    "skewed" (every token of every rank to experts 0 and 1, so experts 2.. get none, and at
    V = 4 ranks 2 and 3 receive nothing; the last rank has no token)."""
    g = torch.Generator().manual_seed(7 + V)
    placement = ExpertPlacement.contiguous(E, V)
    ranks = []
    for r in range(V):
        logits = torch.randn(T, E, generator=g)
        if case == "random":
            logits[:, 1] = -math.inf
        else:
            logits[:, 2:] -= 100.0
        w, ids = logits.softmax(-1).topk(K)
        x, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
        if case == "skewed" and r == V - 1:  # no token: the bucket's rows, every choice dropped
            routing = pad_routing(build_plan(ids[:0], w[:0], placement), T)
            ids, w = ids[:0], w[:0]
            x, dy = x.zero_(), dy.zero_()
        else:
            routing = build_plan(ids, w, placement)
        ranks.append((routing, ids, w, x, dy))
    load = max(int(r[0].counts_E.max()) for r in ranks)
    bucket = ShapeBucket(
        tokens=T,
        hidden=H,
        ffn=F,
        experts=E,
        top_k=K,
        ep_size=V,
        slot_rows=slot_rows_for(load, TILE),
        tile_m=TILE,
    )
    return ranks, bucket


def _weights(E: int):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(E, *s, generator=g) for s in ((H, F), (H, F), (F, H))]  # w1, w3, w2


def _reference(ranks, weights, dtype):
    """y, dx, dtopk per rank and dw1, dw3, dw2 of all experts from ``ReferenceMoE.expert``:
    ``y_t = sum_k w_tk expert_{ids_tk}(x_t)``, loss ``sum_r <y_r, dy_r>``."""
    E = weights[0].shape[0]
    ref = ReferenceMoE(MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K))
    ref = ref.to(dtype)
    with torch.no_grad():
        for name, w in zip(("w1", "w3", "w2"), weights):
            ref.get_parameter(f"experts.{name}").copy_(w)
    out = []
    loss = torch.zeros((), dtype=dtype)
    for _, ids, w, x, dy in ranks:
        n = ids.shape[0]  # the rank's tokens (0: none)
        x, dy = x[:n], dy[:n]
        x = x.detach().to(dtype, copy=True).requires_grad_()
        w = w.detach().to(dtype, copy=True).requires_grad_()
        y = torch.zeros(n, H, dtype=dtype)
        for t in range(n):
            for k in range(K):
                y[t] = y[t] + w[t, k] * ref.expert(int(ids[t, k]), x[t : t + 1])[0]
        loss = loss + (y * dy.to(dtype)).sum()
        out.append((y, x, w))
    loss.backward()
    per_rank = []
    for y, x, w in out:
        n = y.shape[0]
        dx = x.grad if n else x.new_zeros(0, H)
        dtopk = w.grad if n else w.new_zeros(0, K)
        per_rank.append({"y_TH": y.detach(), "dx_TH": dx, "dtopk_TK": dtopk})
    grads = {n: ref.get_parameter(f"experts.{n}").grad for n in ("w1", "w3", "w2")}
    return per_rank, grads


def _run(ranks, bucket, weights):
    from moesaic.taskflow.runtime.persistent import run_virtual

    V, e = bucket.ep_size, bucket.local_experts
    fwd, bwd = compile_world(bucket, "forward"), compile_world(bucket, "backward")
    routings = [r[0] for r in ranks]

    def local(r):
        w1, w3, w2 = (w[r * e : (r + 1) * e] for w in weights)
        return {"w1": w1.reshape(-1, F), "w3": w3.reshape(-1, F), "w2": w2.reshape(-1, H)}

    ins = [{"x_TH": ranks[r][3], **local(r)} for r in range(V)]
    out, _ = run_virtual(lower_world(fwd), fwd, ins, routings)
    ins = [{"dy_TH": ranks[r][4], **local(r), **{k: out[r][k] for k in SAVED}} for r in range(V)]
    grads, _ = run_virtual(lower_world(bwd), bwd, ins, routings)
    return out, grads


@pytest.mark.parametrize(("V", "case"), [(2, "random"), (4, "skewed")])
def test_virtual_ranks_match_reference(V, case, close):
    ranks, bucket = _world(V, case)
    weights = _weights(bucket.experts)
    out, grads = _run(ranks, bucket, weights)
    ref32, dw32 = _reference(ranks, weights, torch.float32)
    ref64, dw64 = _reference(ranks, weights, torch.float64)
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

    ranks, bucket = _world(2, "random")
    weights = _weights(bucket.experts)
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
