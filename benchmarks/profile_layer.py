"""Where a training step of the MoE layer spends its time, per phase, forward and backward.

``python benchmarks/profile_layer.py [--out benchmarks/results/layer_profile.json]``

Profiles (torch.profiler, CPU, one thread per rank) the forward+backward of moesaic ``dropless``
and ``padded`` (capacity factor 1.25) and of torchtitan's MoE (when installed; see
``moesaic.bench.peers``) at EP 1 and EP 2 (a gloo world, ``run_world``), at the default bench
shape (H=256, F=512, E=8, K=2, 1024 tokens per rank), uniform and skewed routing.

Phases are ``record_function`` ranges put around the layer's functions by this script (nothing
in the library changes): route, permute (gathers into expert-grouped rows and the regroup after
the all-to-all), counts exchange, all-to-all (rows), grouped GEMMs, activation (the expert FFN
outside its GEMMs), unpermute/combine, aux loss. Every forward op's self time goes to its
innermost phase; every backward node goes to the phase of the forward op that created it (the
profiler's ``sequence_nr`` links them), so the backward is split exactly the same way. Times are
profiled CPU milliseconds per step (the profiler adds some overhead); ``step_ms`` is the median
unprofiled step time from the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moesaic.bench import layer as bl
from moesaic.bench.allocator import retain_freed_memory
from moesaic.bench.meta import run_metadata
from moesaic.bench.peer_names import peer_installed
from moesaic.comm.world import run_world

PHASES = (
    "route",
    "permute",
    "counts exchange",
    "all-to-all",
    "grouped GEMMs",
    "activation",
    "unpermute/combine",
    "aux loss",
)
PREFIX = "phase::"


def _wrap(owner, attr: str, phase: str, when=None) -> None:
    """Put ``owner.attr`` (for calls where ``when(*args, **kwargs)``) in a phase range."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if when is not None and not when(*args, **kwargs):
            return fn(*args, **kwargs)
        with record_function(PREFIX + phase):
            return fn(*args, **kwargs)

    setattr(owner, attr, wrapped)


def _instrument_moesaic() -> None:
    """Phase ranges around moesaic's functions (this process only)."""
    from moesaic import experts, layer
    from moesaic.comm.collectives import EPGroup
    from moesaic.routing import RoutingPlan
    from moesaic.strategies import base, dropless, padded

    _wrap(layer.MoELayer, "route", "route")
    _wrap(RoutingPlan, "permute", "permute")
    _wrap(dropless.DroplessStrategy, "dispatch_send", "permute")
    _wrap(dropless.DroplessStrategy, "dispatch_recv", "permute")
    _wrap(dropless.DroplessStrategy, "combine_send", "permute")
    _wrap(padded.PaddedStrategy, "dispatch_send", "permute")
    _wrap(padded.PaddedStrategy, "dispatch_recv", "permute")
    _wrap(padded.PaddedStrategy, "combine_send", "permute")
    # Only the metadata exchange: the rows' all-to-all comes through the same method.
    _wrap(
        EPGroup,
        "all_to_all_single",
        "counts exchange",
        when=lambda *a, **k: "count" in k.get("what", ""),
    )
    _wrap(EPGroup, "all_reduce", "counts exchange")
    _wrap(base, "all_to_all_v", "all-to-all")
    _wrap(experts, "grouped_mm", "grouped GEMMs")
    _wrap(experts, "expert_ffn", "activation")
    _wrap(dropless.DroplessStrategy, "combine_recv", "unpermute/combine")
    _wrap(padded.PaddedStrategy, "combine_recv", "unpermute/combine")
    _wrap(RoutingPlan, "unpermute", "unpermute/combine")
    _wrap(bl, "aux_loss", "aux loss")


def _instrument_torchtitan(peer) -> None:
    moe = peer.inner
    d = moe.routed_experts.token_dispatcher
    for attr, phase in (
        ("_local_reorder", "permute"),
        ("_permute", "permute"),
        ("_unpermute", "permute"),
        ("_token_count_exchange", "counts exchange"),
        ("_sync_token_count_exchange", "counts exchange"),
        ("_dispatch_token_exchange", "all-to-all"),
        ("_combine_token_exchange", "all-to-all"),
        ("combine", "unpermute/combine"),
    ):
        _wrap(d, attr, phase)
    experts = moe.routed_experts.inner_experts
    _wrap(experts, "forward", "activation")
    _wrap(experts, "_grouped_mm", "grouped GEMMs")
    _wrap(moe.router, "forward", "route")


def _breakdown(prof, steps: int) -> tuple[dict, list]:
    """Per-phase forward/backward CPU ms per step, and the top ops by self time."""
    events = prof.events()
    seq_phase: dict[int, str] = {}
    fwd: dict[str, float] = defaultdict(float)
    bwd: dict[str, float] = defaultdict(float)

    def phase_of(ev) -> str | None:
        while ev is not None:
            if ev.name.startswith(PREFIX):
                return ev.name[len(PREFIX) :]
            ev = ev.cpu_parent
        return None

    def in_backward(ev) -> str | None:
        while ev is not None:
            if ev.name.startswith("autograd::engine::evaluate_function"):
                return ev
            ev = ev.cpu_parent
        return None

    # Forward ops name the phase of their backward node by sequence number. An op records the
    # number the next autograd node will take, so ops that create no node (before the one that
    # does) carry it too: the latest op with a number is the one that created its node.
    latest: dict[int, float] = {}
    for ev in events:
        if ev.name.startswith(PREFIX) or ev.sequence_nr < 0 or in_backward(ev) is not None:
            continue
        phase = phase_of(ev)
        if phase is not None and ev.time_range.start >= latest.get(ev.sequence_nr, -1.0):
            latest[ev.sequence_nr] = ev.time_range.start
            seq_phase[ev.sequence_nr] = phase
    for ev in events:
        if ev.name == "step":
            continue
        node = in_backward(ev)
        # A phase range's own self time is Python in that phase, e.g. waiting for a collective.
        self_ms = ev.self_cpu_time_total / 1e3
        if node is None:
            fwd[phase_of(ev) or "other"] += self_ms
        else:
            bwd[seq_phase.get(node.sequence_nr, "other")] += self_ms
    phases = {
        p: {"fwd_ms": fwd.get(p, 0.0) / steps, "bwd_ms": bwd.get(p, 0.0) / steps}
        for p in (*PHASES, "other")
    }
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    ops = [
        {"op": a.key, "self_ms": a.self_cpu_time_total / 1e3 / steps, "calls": a.count // steps}
        for a in top
    ]
    return phases, ops


def _modules(bench: bl.LayerBench, routing: str, world: int) -> dict:
    """dropless (+ torchtitan, checked against it) and padded at the bench's capacity factor."""
    modules, _ = bl._modules(bench, routing, world)
    cf = bench.capacity_factor
    modules[f"padded-cf{cf:g}"] = bl._layer(bench, "padded", routing, capacity_factor=cf)
    return modules


def worker(rank: int, world: int, bench: bl.LayerBench, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    retain_freed_memory()  # as moesaic bench layer does (moesaic.bench.allocator)
    _instrument_moesaic()
    out = []
    for routing in bl.ROUTINGS:
        x, g = bl._inputs(bench, routing, rank)
        modules = _modules(bench, routing, world)
        for name, module in modules.items():
            if name == "torchtitan":
                _instrument_torchtitan(module)
        times = bl._interleaved(bench, modules, x, g)
        for name, module in modules.items():
            step = functools.partial(bl._train_step, module, x, g)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    with record_function("step"):
                        step()
            phases, ops = _breakdown(prof, steps)
            out.append(
                {
                    "ep": world,
                    "rank": rank,
                    "impl": name,
                    "routing": routing,
                    "step_ms": 1e3 * statistics.median(times[name]),
                    "phases": phases,
                    "profiled_ms": sum(v["fwd_ms"] + v["bwd_ms"] for v in phases.values()),
                    "top_ops": ops,
                }
            )
    return out


def half_dtypes(bench: bl.LayerBench) -> dict:
    """dropless fwd+bwd step with fp32, bf16 and fp16 activations (same layer, fp32 weights),
    interleaved at EP 1; the experts' compute dtype is ``moesaic.experts.expert_compute_dtype``."""
    from moesaic import experts
    from moesaic.experts import cpu_has_native_matmul, expert_compute_dtype

    torch.set_num_threads(1)
    layer = bl._layer(bench, "dropless", "uniform")
    x, g = bl._inputs(bench, "uniform", 0)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    inputs = {k: (x.to(d), g.to(d)) for k, d in dtypes.items()}
    times: dict[str, list[float]] = {k: [] for k in dtypes}
    # bf16 as a CPU without a native bf16 matmul runs it (moesaic computes in fp32 there).
    inputs["bf16_on_a_cpu_without_native_bf16"] = inputs["bf16"]
    times["bf16_on_a_cpu_without_native_bf16"] = []
    native = experts.cpu_has_native_matmul
    for r in range(bench.warmup + bench.iters):
        for k, (xd, gd) in inputs.items():
            if k == "bf16_on_a_cpu_without_native_bf16":
                experts.cpu_has_native_matmul = lambda dtype: dtype == torch.float32
            start = time.perf_counter()
            bl._train_step(layer, xd, gd)
            if r >= bench.warmup:
                times[k].append(time.perf_counter() - start)
            experts.cpu_has_native_matmul = native
    out = {k: {"step_ms": 1e3 * statistics.median(v)} for k, v in times.items()}
    out["bf16_on_a_cpu_without_native_bf16"]["vs_fp32"] = (
        out["bf16_on_a_cpu_without_native_bf16"]["step_ms"] / out["fp32"]["step_ms"]
    )
    for k, d in dtypes.items():
        out[k]["vs_fp32"] = out[k]["step_ms"] / out["fp32"]["step_ms"]
        out[k]["cpu_native_matmul"] = cpu_has_native_matmul(d)
        out[k]["expert_compute_dtype"] = str(expert_compute_dtype(torch.device("cpu"), d))
    return out


def markdown(result: dict) -> str:
    """The breakdown as a markdown table (fwd+bwd ms per phase; rank 0)."""
    head = ["EP", "impl", "routing", "step ms", *PHASES, "other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        if r["rank"]:
            continue
        cells = [
            f"{v['fwd_ms']:.1f}+{v['bwd_ms']:.1f}"
            for v in (r["phases"][p] for p in (*PHASES, "other"))
        ]
        lines.append(
            f"| {r['ep']} | {r['impl']} | {r['routing']} | {r['step_ms']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/layer_profile.json")
    parser.add_argument("--ep", default="1,2", help="EP sizes (default 1,2)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per module")
    parser.add_argument("--iters", type=int, default=8, help="unprofiled timed steps")
    args = parser.parse_args(argv)
    peers = ("torchtitan",) if peer_installed("torchtitan") else ()
    bench = bl.LayerBench(
        tokens_per_rank=args.tokens,
        iters=args.iters,
        warmup=2,
        peers=peers,
        with_transformers=False,
        strategies=("dropless",),
    )
    rows = []
    load_before = os.getloadavg()
    start = time.time()
    for ep in (int(v) for v in args.ep.split(",")):
        b = dataclasses.replace(bench, ep_sizes=(ep,))
        if ep == 1:
            rows += worker(0, 1, b, args.steps)
        else:
            for r in run_world(worker, ep, b, args.steps, timeout_s=900, pg_timeout_s=300):
                rows += r
    halves = half_dtypes(dataclasses.replace(bench, iters=max(args.iters, 8)))
    result = {
        "benchmark": "benchmarks/profile_layer.py",
        "half_dtypes_ep1": halves,
        "meta": run_metadata(),
        "load_avg_before_after": [load_before, os.getloadavg()],
        "allocator": "glibc, freed memory retained (moesaic.bench.allocator)",
        "wall_s": time.time() - start,
        "config": dataclasses.asdict(bench),
        "phases": list(PHASES),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(markdown(result))
    print("half activations (EP 1 dropless):", json.dumps(halves))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
