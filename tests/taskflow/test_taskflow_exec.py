"""The sequential executor runs compiled plans and matches ``ReferenceMoE``, forward and backward.

The same 24 tokens are split over EP = 1, 2 and 4 ranks (T = 24 / P per rank); every rank
regenerates the whole data set from seeds, and the parent process runs the reference once per
case on all 24 tokens. One spawned world per EP size runs every case (a spawn costs seconds).

Compared: the layer output and the input gradient (the expert path from the backward plan plus
the router path, which autograd finishes from the plan's routing-weight gradient), the w1/w2/w3
gradients of each rank's local experts, and the router weight gradient summed over ranks.

Tolerance: ``assert_close_to_ref`` (moesaic.testing): the plan's fp32 result may be at most twice
as far from a float64 reference as the float32 reference itself is, plus 4 float32 ulps of the
tensor's scale. The plan changes only how rows are tiled and in which order tiles run, never the
arithmetic inside a row, so anything beyond ordinary fp32 rounding is a bug. Order changes
(RATR, interleaving) are compared bitwise: every output row is written by exactly one task.
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moesaic.comm.collectives import CollectiveError, EPGroup
from moesaic.config import MoEConfig
from moesaic.placement import ExpertPlacement
from moesaic.reference import ReferenceMoE
from moesaic.routing import Router
from moesaic.taskflow import (
    CompileOptions,
    ShapeBucket,
    compile_plan,
    load_plan,
    save_plan,
    slot_rows_for,
)
from moesaic.taskflow.runtime import run_backward, run_forward
from moesaic.taskflow.runtime.sequential import _check_world_plan, step_routing
from moesaic.testing import assert_close_to_ref, run_world

N, H, F, E = 24, 16, 12, 8
DEFAULT = CompileOptions()


@dataclass(frozen=True)
class Case:
    name: str
    seed: int
    top_k: int = 2
    activation: str = "swiglu"
    score_func: str = "softmax"
    normalize: bool = True
    tile_m: int = 2
    gmm_tile_m: int | None = None
    fwd: CompileOptions = DEFAULT
    bwd: CompileOptions = DEFAULT
    skew: bool = False


CASES = (
    Case(name="swiglu", seed=1),
    # GELU, sigmoid scores, 4-row GMM tiles over 2-row dispatch tiles (many-to-one events), and
    # Alg. 1 fall-backs: an unsplit GMM1 (act, gmm2, combine follow) and unsplit backward GMMs.
    Case(name="gelu-fallback", seed=2, top_k=3, activation="gelu", score_func="sigmoid",
         normalize=False, gmm_tile_m=4,
         fwd=CompileOptions(ratr=False, unsplit=("gmm1",)),
         bwd=CompileOptions(unsplit=("gmm_act_grad", "gmm_w1_grad"))),
    # Every token to experts 0 and 1: the other slots (and ranks, at EP > 1) receive nothing,
    # so most tiles are empty and still fire their events.
    Case(name="skew", seed=3, skew=True),
)  # fmt: skip


def _cfg(c: Case) -> MoEConfig:
    return MoEConfig(hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=c.top_k,
                     activation=c.activation, score_func=c.score_func,
                     normalize_topk=c.normalize)  # fmt: skip


def _data(c: Case) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(c.seed)
    d = {
        "router": torch.randn(E, H, generator=gen) * 0.5,
        "w1": torch.randn(E, H, F, generator=gen) / H**0.5,
        "w3": torch.randn(E, H, F, generator=gen) / H**0.5,
        "w2": torch.randn(E, F, H, generator=gen) / F**0.5,
        "x": torch.randn(N, H, generator=gen),
        "dy": torch.randn(N, H, generator=gen),
    }
    if c.skew:
        d["x"][:, 0] = d["x"][:, 0].abs() + 1.0
        d["router"][:2, 0] += 4.0
    return d


def run_case(c: Case, P: int, rank: int, group: EPGroup, tmp: Path, naive: bool = False):
    """One rank's forward and backward through compiled (and reloaded) plans."""
    d, T, e = _data(c), N // P, E // P
    rows, local = slice(rank * T, (rank + 1) * T), slice(rank * e, (rank + 1) * e)
    router = Router(_cfg(c))
    with torch.no_grad():
        router.weight.copy_(d["router"])
    x = d["x"][rows].clone().requires_grad_()
    routing, _ = router(x, ExpertPlacement.contiguous(E, P))
    # One bucket for the whole world: the largest slot load of any rank.
    worst = group.all_reduce(routing.counts_E.max().reshape(1), dist.ReduceOp.MAX, "max load")
    bucket = ShapeBucket(tokens=T, hidden=H, ffn=F, experts=E, top_k=c.top_k, ep_size=P,
                         slot_rows=slot_rows_for(int(worst), c.gmm_tile_m or c.tile_m),
                         tile_m=c.tile_m, gmm_tile_m=c.gmm_tile_m, activation=c.activation)  # fmt: skip
    plans = {}
    for direction, opts in (("forward", c.fwd), ("backward", c.bwd)):
        opts = CompileOptions(ratr=False, interleave=False, unsplit=opts.unsplit) if naive else opts
        path = save_plan(compile_plan(bucket, direction, rank, opts), tmp / f"{direction}.json")
        plans[direction] = load_plan(path)
    w3 = d["w3"][local] if c.activation == "swiglu" else None
    fwd = run_forward(plans["forward"], x.detach(), routing, d["w1"][local], d["w2"][local], w3,
                      group=group)  # fmt: skip
    bwd = run_backward(plans["backward"], d["dy"][rows], routing, fwd.saved, d["w1"][local],
                       d["w2"][local], w3, group=group)  # fmt: skip
    gx, grouter = torch.autograd.grad(
        routing.topk_weights_TK, (x, router.weight), bwd.dtopk_weights_TK
    )
    out = {"y": fwd.y_TH, "dx": bwd.dx_TH + gx, "dw1": bwd.dw1_eHF, "dw2": bwd.dw2_eFH,
           "drouter": grouter}  # fmt: skip
    if w3 is not None:
        out["dw3"] = bwd.dw3_eHF
    return out


@functools.cache
def reference(name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    c = next(c for c in CASES if c.name == name)
    d = _data(c)
    sd = {"router.weight": d["router"], "experts.w1": d["w1"], "experts.w2": d["w2"]}
    if c.activation == "swiglu":
        sd["experts.w3"] = d["w3"]
    ref = ReferenceMoE.from_full_state_dict(_cfg(c), sd).to(dtype)
    x = d["x"].to(dtype).requires_grad_()
    y, _ = ref(x)
    (y * d["dy"].to(dtype)).sum().backward()
    out = {"y": y.detach(), "dx": x.grad, "drouter": ref.router.weight.grad,
           "dw1": ref.experts.w1.grad, "dw2": ref.experts.w2.grad}  # fmt: skip
    if c.activation == "swiglu":
        out["dw3"] = ref.experts.w3.grad
    return out


def check_against_reference(name: str, per_rank: list[dict[str, torch.Tensor]]) -> None:
    got = {k: torch.cat([r[k] for r in per_rank]) for k in per_rank[0] if k != "drouter"}
    got["drouter"] = sum(r["drouter"] for r in per_rank)
    r64, r32 = reference(name, torch.float64), reference(name, torch.float32)
    assert set(got) == set(r64)
    for k in got:
        assert_close_to_ref(got[k], r32[k], r64[k], f"{name}: {k} (EP={len(per_rank)})")


def taskflow_world(rank: int, world: int) -> dict:
    group = EPGroup(None, timeout_s=60)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in CASES:
            results[c.name] = run_case(c, world, rank, group, Path(tmp))
        if world == 2:
            results["errors"] = _error_paths(rank, group, Path(tmp))
    return results


def two_rank_inputs(c: Case, rank: int):
    """This rank's half of case ``c``'s tokens at EP = 2: tokens, routing, local weights."""
    d = _data(c)
    x = d["x"][rank * 12 : (rank + 1) * 12]
    router = Router(_cfg(c))
    with torch.no_grad():
        router.weight.copy_(d["router"])
    routing, _ = router(x, ExpertPlacement.contiguous(E, 2))
    w = (d["w1"][rank * 4 : rank * 4 + 4], d["w2"][rank * 4 : rank * 4 + 4],
         d["w3"][rank * 4 : rank * 4 + 4])  # fmt: skip
    return x, routing, w


def _error_paths(rank: int, group: EPGroup, tmp: Path) -> dict[str, str]:
    """Plans compiled with different options on the two ranks; then a peer that never sends."""
    c = CASES[0]
    b = ShapeBucket(tokens=N // 2, hidden=H, ffn=F, experts=E, top_k=2, ep_size=2,
                    slot_rows=N, tile_m=4)  # fmt: skip
    plan = compile_plan(b, "forward", rank, CompileOptions(ratr=rank == 0))
    x, routing, w = two_rank_inputs(c, rank)
    out = {}
    try:
        run_forward(plan, x, routing, *w, group=group)
    except ValueError as exc:
        out["mismatch"] = str(exc)
    plan = compile_plan(b, "forward", rank)
    if rank == 1:  # agree on the plan and the counts, then never send or receive a tile
        _check_world_plan(plan, group)
        step_routing(plan, routing, group)
        return out
    try:
        run_forward(plan, x, routing, *w, group=group, timeout_s=1.0)
    except CollectiveError as exc:
        out["timeout"] = str(exc)
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ep1_matches_reference_and_is_order_invariant(case, tmp_path):
    group = EPGroup(None, timeout_s=10)
    first = run_case(case, 1, 0, group, tmp_path)
    check_against_reference(case.name, [first])
    again = run_case(case, 1, 0, group, tmp_path)
    naive = run_case(case, 1, 0, group, tmp_path, naive=True)
    for k in first:
        assert torch.equal(first[k], again[k]), f"{k}: two runs differ"  # determinism
        assert torch.equal(first[k], naive[k]), f"{k}: RATR/interleaving changed a result"


@pytest.mark.parametrize("world", [2, 4])
def test_ep_worlds_match_reference(world):
    per_rank = run_world(taskflow_world, world, timeout_s=240)
    for c in CASES:
        check_against_reference(c.name, [r[c.name] for r in per_rank])
    if world == 2:
        for r in per_rank:
            assert "compiled for different buckets or options" in r["errors"]["mismatch"]
        timeout = per_rank[0]["errors"]["timeout"]
        # rank 1 agreed on the plan and the counts, then never sent a tile: rank 0's first
        # receive from it fails within the 1 s bound (a timeout, or a reset once rank 1 exits).
        assert "taskflow receive of" in timeout and "from rank 1" in timeout
        assert "within 1s" in timeout
