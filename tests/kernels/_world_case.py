"""A world of V virtual ranks for the persistent kernel's tests (tests/kernels under Triton's
interpreter, tests/gpu on one device): every rank's routing, tokens and output gradient, the
expert weights, one forward and backward of every rank's plans in one launch each
(``run_virtual``), and the same from ``moesaic.reference`` (``ReferenceMoE.expert``)."""

from __future__ import annotations

import math

import torch

from moesaic.config import MoEConfig
from moesaic.placement import ExpertPlacement
from moesaic.reference import ReferenceMoE
from moesaic.routing import build_plan
from moesaic.strategies.taskflow import pad_routing
from moesaic.taskflow import ShapeBucket, slot_rows_for
from moesaic.taskflow.compile import compile_world
from moesaic.taskflow.lower import lower_world
from moesaic.taskflow.runtime.sequential import SAVED

T, H, F, K, TILE = 5, 20, 18, 2, 4


def world_case(V: int, case: str, E: int = 4):
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


def expert_weights(E: int):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(E, *s, generator=g) for s in ((H, F), (H, F), (F, H))]  # w1, w3, w2


def reference(ranks, weights, dtype):
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


def run_case(ranks, bucket, weights, device: str | torch.device = "cpu"):
    """Every rank's forward buffers and backward buffers (on the CPU), run on ``device``."""
    from moesaic.taskflow.runtime.persistent import run_virtual

    V, e = bucket.ep_size, bucket.local_experts
    fwd, bwd = compile_world(bucket, "forward"), compile_world(bucket, "backward")
    routings = [r[0] for r in ranks]

    def local(r):
        w1, w3, w2 = (w[r * e : (r + 1) * e] for w in weights)
        ws = {"w1": w1.reshape(-1, F), "w3": w3.reshape(-1, F), "w2": w2.reshape(-1, H)}
        return {k: v.to(device) for k, v in ws.items()}

    ins = [{"x_TH": ranks[r][3].to(device), **local(r)} for r in range(V)]
    out, _ = run_virtual(lower_world(fwd), fwd, ins, routings)
    ins = [
        {"dy_TH": ranks[r][4].to(device), **local(r), **{k: out[r][k] for k in SAVED}}
        for r in range(V)
    ]
    grads, _ = run_virtual(lower_world(bwd), bwd, ins, routings)
    cpu = [[{k: v.cpu() for k, v in b.items()} for b in bufs] for bufs in (out, grads)]
    return cpu[0], cpu[1]
