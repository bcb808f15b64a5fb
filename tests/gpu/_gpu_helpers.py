"""The bodies of the GPU tests, written for any device (``"cuda"`` or ``"cpu"``).

Each world function runs on every rank of a ``run_world`` and returns, per case, either the
case's results or the traceback of its failure (``{"error": ...}``), so that one failing
strategy does not hide the others and the test names each one. The same bodies run on CPU
where a CPU twin is quick and not already covered elsewhere.
"""

from __future__ import annotations

import itertools
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moesaic import MoEConfig, MoELayer, aux_loss
from moesaic.comm.collectives import record_collectives
from moesaic.strategies import get_strategy, strategy_names
from moesaic.strategies.base import DispatchCombineStrategy
from moesaic.testing import assert_close_to_ref, reference_world

# Every test that needs a GPU carries both: ``-m gpu`` selects them, and without CUDA they skip.
NEEDS_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
H, F_, E = 16, 24, 8
SCHEDULES = ("vanilla", "moe-only", "flowmoe")
# The pipelined schedules run a strategy's dispatch and combine as separate stages.
PHASED = [s for s in strategy_names() if issubclass(get_strategy(s), DispatchCombineStrategy)]
B, T, R, STEPS = 4, 8, 2, 2
SP = 4096  # gradient chunk bytes: the replicated gradients (~60 KB) leave in many chunks
# Parameters after SGD at lr 1 move by the gradient. On CUDA a pipelined schedule's R chunks of
# B/R rows are summed by other cuBLAS kernels (chosen by shape, split-K) than one matmul of B
# rows, and atomics reorder the index backward: fp32 reordering over these <= 64-term sums is
# <= 64 ulp (4e-6) relative; 1e-4 leaves 25x. (The CPU tests hold 1e-5 with MKL's fixed order.)
RTOL, ATOL = 1e-4, 1e-5


def device_of(kind: str) -> torch.device:
    """This rank's device: ``run_world(device=...)`` made its GPU the current one."""
    return (
        torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    )


def attempt(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """``{"value": fn(*args)}``, or ``{"error": traceback}`` if it raised."""
    try:
        return {"value": fn(*args)}
    except Exception:
        return {"error": traceback.format_exc()}


# ---- one MoE layer step against the reference ---------------------------------------------


def layer_cases(world: int) -> list[tuple[str, dict[str, Any], Callable[[int], int]]]:
    """(name, MoEConfig overrides, tokens of rank r) for every registered strategy: uneven
    batches without drops, and capacity drops; on 4 ranks also hybrid with domains of 2 (its
    level and prefetch groups then differ from the EP group)."""
    cases = []
    for s in strategy_names():
        cases.append((f"{s}/uneven", {"dispatcher": s}, lambda r: 6 + 3 * r))
        cases.append((f"{s}/capacity", {"dispatcher": s, "capacity_factor": 0.75}, lambda r: 12))
    if world == 4:
        hybrid = {"dispatcher": "hybrid", "options": {"domain_sizes": (2,)}}
        cases.append(("hybrid/domains-2", hybrid, lambda r: 12))
    return cases


def check_layer(
    device: torch.device, group: Any, overrides: dict[str, Any], tokens: Callable[[int], int]
) -> None:
    """Forward + backward of one layer (loss = sum(y * g) + aux) on ``device``: output, aux
    loss, input, expert and router gradients against the reference over every rank's tokens
    (run on the CPU in fp32 and fp64; ``assert_close_to_ref``'s relative rule)."""
    cfg = MoEConfig(hidden_size=H, ffn_hidden_size=F_, num_experts=E, init_std=0.5, **overrides)
    torch.manual_seed(4321)
    layer = MoELayer(cfg, group).to(device)
    sd = {k: v.cpu() for k, v in layer.full_state_dict().items()}
    P, rank = layer.ep.size, layer.ep.rank
    xs = [torch.randn(tokens(p), H, generator=_seeded(1000 + p)) for p in range(P)]
    gs = [torch.randn(x.shape, generator=_seeded(7 + p)) for p, x in enumerate(xs)]
    x = xs[rank].to(device).requires_grad_()
    y = layer(x)
    aux = aux_loss(layer)
    ((y * gs[rank].to(device)).sum() + aux).backward()
    assert x.grad is not None
    router_grad = layer.router.weight.grad.clone()
    layer.ep.all_reduce(router_grad, what="router gradient (test)")  # replicated: sum over ranks

    ref = reference_world(cfg, sd, xs, gs)
    (y32, a32, gx32, gw32), (y64, a64, gx64, gw64) = ref[torch.float32], ref[torch.float64]
    assert_close_to_ref(y.detach().cpu(), y32[rank].detach(), y64[rank].detach(), "y")
    assert_close_to_ref(aux.detach().cpu(), a32[rank].detach(), a64[rank].detach(), "aux")
    assert_close_to_ref(x.grad.cpu(), gx32[rank], gx64[rank], "x.grad")
    lo, hi = rank * E // P, (rank + 1) * E // P
    for name in ("w1", "w3", "w2"):
        got = getattr(layer.experts, name).grad.cpu()
        key = f"experts.{name}"
        assert_close_to_ref(got, gw32[key][lo:hi], gw64[key][lo:hi], f"{key}.grad")
    key = "router.weight"
    assert_close_to_ref(router_grad.cpu(), gw32[key], gw64[key], f"{key}.grad")


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def layer_world(rank: int, world: int, kind: str, group_backend: str | None) -> dict:
    """Every layer case on this rank, each with its recorded collectives. ``group_backend``:
    the layers' group is a new group of that backend (``"nccl"``: control-plane tensors then
    live on the GPU), else the world."""
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), backend=group_backend) if group_backend else None
    out = {}
    for name, overrides, tokens in layer_cases(world):
        with record_collectives() as log:
            result = attempt(check_layer, device_of(kind), group, overrides, tokens)
        out[name] = {**result, "log": list(log)}
    return out


def world_of_one(rank: int, world: int, kind: str, group_backend: str | None) -> dict:
    """``layer_world`` of a one-process world with the single-rank shortcuts off, so that
    every collective of every strategy is issued for real."""
    os.environ["MOESAIC_NO_SHORTCUTS"] = "1"  # read by every EPGroup built from here on
    return layer_world(rank, world, kind, group_backend)


# ---- training steps under each schedule --------------------------------------------------


def model_config(strategy: str):
    from moesaic.models import MoEGPTConfig

    moe = {"num_experts": 4, "top_k": 2, "ffn_hidden_size": 32, "dispatcher": strategy}
    moe |= {"aux_loss_coef": 0.1, "z_loss_coef": 0.01}  # large, so their gradients matter
    return MoEGPTConfig.from_dict(
        {"d_model": 32, "n_layers": 3, "dense_layers": 1, "n_heads": 2, "seq_len": T, "moe": moe}
    )


def lm_loss(logits_BTV: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.flatten(0, 1).float(), y_BT.flatten())


def schedule_cases() -> list[tuple[str, str]]:
    """(schedule, strategy): vanilla runs every strategy, the pipelined ones the phased."""
    return [(s, d) for s in SCHEDULES for d in strategy_names() if s == "vanilla" or d in PHASED]


def run_schedule(layout, device: torch.device, schedule: str, strategy: str, batches) -> dict:
    """``STEPS`` SGD steps (lr 1) of a small MoEGPT under ``schedule``: parameters after each
    step (on the CPU) and each step's recorded collectives."""
    from moesaic.models import MoEGPT
    from moesaic.schedule import make_step
    from moesaic.schedule.base import StepParts
    from moesaic.train.parallel import GradientSync

    torch.manual_seed(0)
    model = MoEGPT(model_config(strategy), ep_group=layout.ep_group).to(device)
    parts = StepParts(
        model=model,
        loss_fn=lm_loss,
        grad_sync=GradientSync(layout),
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        pipeline_degree=1 if schedule == "vanilla" else R,
        ar_chunk_bytes=SP,
    )
    step = make_step(schedule, parts)
    params, logs = [], []
    for x_BT in batches:
        with record_collectives() as log:
            result = step.run(x_BT[:, :-1], x_BT[:, 1:])
        assert result.applied
        logs.append(list(log))
        params.append({n: p.detach().cpu().clone() for n, p in model.named_parameters()})
    if hasattr(step, "close"):
        step.close()
    return {"params": params, "logs": logs}


def schedule_world(rank: int, world: int, kind: str) -> dict:
    """Every (schedule, strategy) case on an EP group of the whole world."""
    from moesaic.train.parallel import build_layout

    device = device_of(kind)
    layout = build_layout(world, 60.0)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    batches = [torch.randint(0, 256, (B, T + 1), generator=gen).to(device) for _ in range(STEPS)]
    return {
        case: attempt(run_schedule, layout, device, *case, batches) for case in schedule_cases()
    }


def gloo_world(rank: int, world: int, kind: str) -> dict:
    """The layer cases and the schedule cases on one world (one spawn per EP size)."""
    layers = layer_world(rank, world, kind, None)
    return {"layers": layers, "schedules": schedule_world(rank, world, kind)}


# ---- comparisons ---------------------------------------------------------------------------


def assert_same_order(logs: Sequence[Sequence[tuple]], label: str) -> None:
    """For every pair of ranks, the collectives on the groups holding both are one sequence
    (NCCL's rule); the message names the first difference."""
    for a, b in itertools.combinations(range(len(logs)), 2):
        seq_a = [e for e in logs[a] if a in e[0] and b in e[0]]
        seq_b = [e for e in logs[b] if a in e[0] and b in e[0]]
        if seq_a != seq_b:
            k = next((i for i, (x, y) in enumerate(zip(seq_a, seq_b)) if x != y), None)
            k = min(len(seq_a), len(seq_b)) if k is None else k
            raise AssertionError(
                f"{label}: ranks {a} and {b} issue different collectives; #{k}: rank {a} "
                f"{seq_a[k] if k < len(seq_a) else 'nothing'}, rank {b} "
                f"{seq_b[k] if k < len(seq_b) else 'nothing'}"
            )


def assert_params_close(got: dict, want: dict, label: str) -> None:
    for name, w in got.items():
        torch.testing.assert_close(w, want[name], rtol=RTOL, atol=ATOL, msg=f"{label} {name}")


def value_or_fail(result: dict, label: str) -> Any:
    """A case's value; a failed case fails the test with the rank's traceback."""
    if "error" in result:
        raise AssertionError(f"{label} failed:\n{result['error']}")
    return result.get("value")
