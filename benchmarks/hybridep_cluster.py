"""HybridEP on an emulated cluster: classic EP vs ``hybrid`` (Table V, Fig. 13), the ablation
Partition vs +Migration (Table VI) and the model's prediction for every point (Fig. 11).

Usage (root: the emulated network needs network namespaces)::

    python benchmarks/hybridep_cluster.py --cluster examples/clusters/hybridep_2dc2.toml \\
        [--sweep traffic|expert|all] [--steps 5] [--out FILE.json] [--trace FILE.json]
        [--loopback]

The model: ``BLOCKS`` blocks of (pre-norm causal self-attention, pre-norm MoE layer), SGD.
One world runs every point; per point, three copies of the model (same seed) are timed
round-robin (one step each per round, a barrier before each step; the step time is the slowest
rank's):

* ``classic EP``: ``dropless`` (tokens to the experts' owners);
* ``Partition``: ``hybrid`` with the domain sizes the cost model chooses for exact experts
  (``plan_step``: the paper's forward plus the backward and the gradient reduce a training step
  adds), gathers issued inside each layer;
* ``+Migration``: ``hybrid`` with SR compression (``COMPRESSION``, domains chosen for the
  compressed size; the shared experts' all-reduce every ``SHARED_EVERY`` gathers) and the
  asynchronous communicator (``ExpertPrefetcher.start()`` at the start of each timed step, so
  that the gathers overlap that step's own pre-expert compute and are charged to it; training
  attaches it to the optimizer step instead, which here would let the gathers run during the
  other variants' steps of the round-robin).

Every rank first measures its GEMM rate while all ranks run (``measure_gemm_flops``); the
minimum over ranks is the compute throughput the model uses, so the chosen domains are the same
everywhere. Predictions: :func:`moesaic.planning.stepmodel.predict_step` for each variant.
Speedups are medians of per-round ratios (same run); the perfect-overlap bound of each figure
is ``max(compute, communication)`` of the model's parts for that variant.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

H, E, K = 256, 8, 2
BLOCKS = 2
SEQ = 256
HEADS = 4
COMPRESSION = 16.0
SHARED_EVERY = 4  # +Migration recomputes the shared experts every 4th gather
WARMUP = 1
# (sweep, tokens per rank, expert hidden F)
POINTS = {
    "traffic": [("traffic", t, 128) for t in (256, 512, 1024, 2048)],
    "expert": [("expert", 1024, f) for f in (64, 256, 512)],
}
VARIANTS = ("classic EP", "Partition", "+Migration")
COMPUTE = "compute only"  # every expert local, no communication: the step's compute


def _hybrid_options(domains: Any, cr: float) -> dict[str, Any]:
    """hybrid's options: compressed gathers recompute the shared experts every SHARED_EVERY."""
    every = SHARED_EVERY if cr > 1 else 1
    return {"domain_sizes": domains, "compression_ratio": cr, "shared_expert_every": every}


def _moe_config(F: int, dispatcher: str, domains: Any = None, cr: float = 1.0) -> Any:
    """The MoE layer; compressed gathers recompute the shared experts every SHARED_EVERY."""
    from moesaic import MoEConfig

    return MoEConfig(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        top_k=K,
        dispatcher=dispatcher,
        options=_hybrid_options(domains, cr) if dispatcher == "hybrid" else None,
        collective_timeout_s=120.0,
    )


def _model(cfg: Any, spec: Any, recorder: Any, group: Any = None) -> Any:
    import torch
    import torch.nn.functional as Fn
    from torch import nn

    from moesaic import MoELayer
    from moesaic.trace import maybe_span

    class Block(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index
            self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
            self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
            self.moe = MoELayer(cfg, group, topology=spec)

        def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
            B, S, _ = x_BSH.shape
            with maybe_span(recorder, "compute", f"AT L{self.index}"):
                q, k, v = self.qkv(self.ln1(x_BSH)).view(B, S, 3, HEADS, H // HEADS).unbind(2)
                att = Fn.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
                )
                x_BSH = x_BSH + self.proj(att.transpose(1, 2).reshape(B, S, H))
            with maybe_span(recorder, "compute", f"MoE L{self.index}"):
                return x_BSH + self.moe(self.ln2(x_BSH))

    torch.manual_seed(0)
    return nn.Sequential(*[Block(i) for i in range(BLOCKS)])


def _plan(spec: Any, F: int, tokens: int, flops: float, cr: float) -> Any:
    """The domains the step model (``plan_step``: forward, backward, gradient reduce) picks."""
    from moesaic.planning.stepmodel import plan_step

    return plan_step(
        spec,
        _moe_config(F, "dropless"),
        tokens_per_rank=tokens,
        flops_per_s=flops,
        blocks=BLOCKS,
        seq_len=SEQ,
        compression_ratio=cr,
        shared_expert_every=SHARED_EVERY if cr > 1 else 1,
        prefetch=cr > 1,
    )


def worker(rank: int, world: int, spec_dict: dict, points: list, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from moesaic.cluster.spec import ClusterSpec
    from moesaic.layer import aux_loss
    from moesaic.sim.hybrid_costmodel import measure_gemm_flops
    from moesaic.strategies.prefetch import ExpertPrefetcher
    from moesaic.trace import Recorder

    torch.set_num_threads(1)
    spec = ClusterSpec.from_dict(spec_dict)
    dist.barrier()
    rate = torch.tensor([measure_gemm_flops(512, repeats=9)])
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    flops = float(rate)
    out: dict[str, Any] = {"flops_per_s": flops, "points": []}
    # The same model with every expert local and no communication: what the step computes,
    # timed under the same contention (all ranks at once), calibrates the compute rate.
    alone = dist.new_group([rank], use_local_synchronization=True)
    for sweep, tokens, F in points:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens // SEQ, SEQ, H, generator=gen)

        def step(model: Any, opt: Any, pre: Any = None, x: Any = x) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            if pre is not None:  # inside the timed step: the gathers overlap its own compute
                pre.start()
            y = model(x)
            (y.square().mean() + aux_loss(model)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        local = _model(_moe_config(F, "dropless"), None, None, alone)
        local_opt = torch.optim.SGD(local.parameters(), lr=1e-3)
        calib = torch.tensor([statistics.median(step(local, local_opt) for _ in range(4))])
        dist.all_reduce(calib, op=dist.ReduceOp.MAX)
        flops_eff = flops * _predicted_compute_s(spec, F, tokens, flops) / float(calib)
        plain = _plan(spec, F, tokens, flops_eff, 1.0)
        compressed = _plan(spec, F, tokens, flops_eff, COMPRESSION)
        settings = {
            "classic EP": ("dropless", None, 1.0, False),
            "Partition": ("hybrid", plain.chosen.domain_sizes, 1.0, False),
            "+Migration": ("hybrid", compressed.chosen.domain_sizes, COMPRESSION, True),
        }
        recorder = Recorder(rank)
        built = {}
        for name, (dispatcher, domains, cr, prefetch) in settings.items():
            cfg = _moe_config(F, dispatcher, domains, cr)
            model = _model(cfg, spec, recorder if name == "+Migration" else None)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            pre = ExpertPrefetcher(model, recorder=recorder) if prefetch else None
            built[name] = (model, opt, pre)
        for model, opt, pre in built.values():
            for _ in range(WARMUP):
                step(model, opt, pre)
        rounds = []
        for i in range(steps):
            if i == steps - 1:
                recorder.clear()
            row = {name: step(model, opt, pre) for name, (model, opt, pre) in built.items()}
            row[COMPUTE] = step(local, local_opt)
            rounds.append(row)
        spans = recorder.events
        # The routing the steps actually had: rows each rank sends each rank, per layer
        # (one more forward, no gradient), for the prediction with the observed traffic.
        rows_P = {}
        for name, (model, _, _) in built.items():
            rows_P[name] = _observed_rows(model, x, world)
            dist.all_reduce(rows_P[name])  # rank r filled row r: [layers, P, P]
        times = torch.tensor([[r[n] for n in (*VARIANTS, COMPUTE)] for r in rounds])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        for _, _, pre in built.values():
            if pre is not None:
                pre.close()
        out["points"].append(
            {
                "sweep": sweep,
                "tokens_per_rank": tokens,
                "ffn_hidden_size": F,
                "flops_per_s_effective": flops_eff,
                "domains": {n: settings[n][1] for n in VARIANTS},
                "reason": {"Partition": plain.reason, "+Migration": compressed.reason},
                "rounds": times.tolist(),
                "rows_LPP": {n: t.tolist() for n, t in rows_P.items()},
                "spans": spans,
            }
        )
    return out


def _observed_rows(model: Any, x: Any, world: int) -> Any:
    """``[layers, P, P]`` rows sent by this rank (its row only) in each MoE layer's all-to-all,
    in EP ranks, read from the plans of one more forward."""
    import torch

    from moesaic.layer import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    out = torch.zeros(len(layers), world, world)
    handles = []
    for i, layer in enumerate(layers):

        def hook(mod: Any, args: Any, i: int = i) -> None:
            plan = mod.route(args[0]).plan
            ranks = getattr(mod.strategy, "offset_ranks", list(range(world)))
            for q, rows in enumerate(plan.send_counts_P.tolist()):
                out[i, mod.ep.rank, ranks[q]] += rows

        handles.append(layer.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    for layer in layers:
        layer.take_stats()
        layer.take_aux_loss()
    return out


def _predicted_compute_s(spec: Any, F: int, tokens: int, flops: float) -> float:
    """The step's compute (pre-expert and expert, forward and backward) at ``flops``."""
    from moesaic.planning.stepmodel import predict_step

    pred = predict_step(
        spec,
        _moe_config(F, "dropless"),
        (1,) * len(spec.levels),
        tokens_per_rank=tokens,
        flops_per_s=flops,
        blocks=BLOCKS,
        seq_len=SEQ,
    )
    return BLOCKS * 3 * (pred.parts["pre_expert"] + pred.parts["expert"])


def _predictions(spec: Any, point: dict, flops: float) -> dict[str, Any]:
    from moesaic.cluster.cost import network_time
    from moesaic.planning.stepmodel import predict_step

    out = {}
    for name in VARIANTS:
        domains = point["domains"][name] or (1,) * len(spec.levels)
        cr = COMPRESSION if name == "+Migration" else 1.0
        pred = predict_step(
            spec,
            _moe_config(point["ffn_hidden_size"], "dropless"),
            domains,
            tokens_per_rank=point["tokens_per_rank"],
            flops_per_s=flops,
            blocks=BLOCKS,
            seq_len=SEQ,
            compression_ratio=cr,
            shared_expert_every=SHARED_EVERY if cr > 1 else 1,
            prefetch=name == "+Migration",
        )
        p = pred.parts
        compute = BLOCKS * 3 * (p["pre_expert"] + p["expert"])
        comm = BLOCKS * (
            p["gather"] + p["shared_all_reduce"] + 4 * p["all_to_all"] + p["grad_reduce"]
        )
        # The same with the all-to-alls priced on the observed rows (not uniform routing).
        observed_s = pred.step_s
        if p["all_to_all"] > 0:
            lat_s = max(level.latency_ms for level in spec.levels) * 1e-3
            for rows_PP in point["rows_LPP"][name]:
                bytes_PP = [[r * H * 4 for r in row] for row in rows_PP]
                a2a_s = network_time(spec, bytes_PP).bandwidth_s + lat_s
                observed_s += 4 * (a2a_s - p["all_to_all"])
        out[name] = {
            "predicted_s": pred.step_s,
            "predicted_observed_routing_s": observed_s,
            "parts_per_block_s": p,
            "compute_s": compute,
            "communication_s": comm,
        }
    return out


def summarize(spec: Any, per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for point in per_rank[0]["points"]:
        rounds = point["rounds"]
        compute_only_s = statistics.median(r[len(VARIANTS)] for r in rounds)
        # The domains were planned with the rate calibrated before the rounds; the predictions
        # use the compute-only step timed in the rounds themselves (same load as the variants).
        T, F, planned = (
            point["tokens_per_rank"],
            point["ffn_hidden_size"],
            point["flops_per_s_effective"],
        )
        rate = planned * _predicted_compute_s(spec, F, T, planned) / compute_only_s
        pred = _predictions(spec, point, rate)
        row: dict[str, Any] = {
            k: point[k]
            for k in ("sweep", "tokens_per_rank", "ffn_hidden_size", "domains", "reason")
        }
        row["data_mb_per_rank"] = T * K * H * 4 / 1e6
        row["expert_mb"] = 3 * H * F * 4 / 1e6
        row["flops_per_s_planned"] = planned
        row["flops_per_s_rounds"] = rate
        row["compute_only_s"] = compute_only_s
        row["variants"] = {}
        for j, name in enumerate(VARIANTS):
            ts = [r[j] for r in rounds]
            measured = statistics.median(ts)
            row["variants"][name] = {
                "measured_s": measured,
                "p10_s": min(ts),
                "p90_s": max(ts),
                **pred[name],
                "model_error": pred[name]["predicted_s"] / measured - 1,
                "model_error_observed_routing": pred[name]["predicted_observed_routing_s"]
                / measured
                - 1,
                # perfect overlap: max(the measured compute-only step, the modelled traffic)
                "overlap_bound_s": max(row["compute_only_s"], pred[name]["communication_s"]),
            }
        for j, name in enumerate(VARIANTS[1:], start=1):
            row[f"speedup {name} vs classic EP"] = statistics.median(r[0] / r[j] for r in rounds)
        row["speedup +Migration vs Partition"] = statistics.median(r[1] / r[2] for r in rounds)
        rows.append(row)
    return rows


def _error_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Geometric-mean error ``exp(mean |ln(predicted / measured)|) - 1`` over every point, per
    variant and overall, for uniform routing (the paper's assumption) and the observed one."""
    out: dict[str, Any] = {}
    for key in ("predicted_s", "predicted_observed_routing_s"):
        logs: dict[str, list[float]] = {n: [] for n in VARIANTS}
        for r in rows:
            for n in VARIANTS:
                v = r["variants"][n]
                logs[n].append(abs(math.log(v[key] / v["measured_s"])))
        every = [x for xs in logs.values() for x in xs]
        out[key] = {n: math.exp(statistics.mean(xs)) - 1 for n, xs in logs.items()}
        out[key]["all"] = math.exp(statistics.mean(every)) - 1
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| sweep | D MB | expert MB | domains P / M | classic s | Partition s | +Migration s "
        "| +Mig vs EP | +Mig vs Part | model err EP / P / M |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r["variants"]
        err = " / ".join(f"{v[n]['model_error']:+.0%}" for n in VARIANTS)
        lines.append(
            f"| {r['sweep']} | {r['data_mb_per_rank']:.1f} | {r['expert_mb']:.2f} | "
            f"{r['domains']['Partition']} / {r['domains']['+Migration']} | "
            + " | ".join(f"{v[n]['measured_s']:.2f}" for n in VARIANTS)
            + f" | {r['speedup +Migration vs classic EP']:.2f}x | "
            f"{r['speedup +Migration vs Partition']:.2f}x | {err} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="examples/clusters/hybridep_2dc2.toml")
    parser.add_argument("--sweep", choices=("traffic", "expert", "all"), default="all")
    parser.add_argument("--steps", type=int, default=5, help="measured rounds per point")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", default=None, help="Chrome trace of the last +Migration step")
    parser.add_argument("--loopback", action="store_true", help="no emulated network (sizing)")
    args = parser.parse_args()

    import hybridep_cluster as mod  # workers unpickle the functions by this module name
    from moesaic.bench.meta import run_metadata
    from moesaic.cluster.spec import ClusterSpec
    from moesaic.trace import write_chrome_trace

    spec = ClusterSpec.from_toml(args.cluster)
    points = POINTS["traffic"] + POINTS["expert"] if args.sweep == "all" else POINTS[args.sweep]
    load_before = os.getloadavg()
    start = time.perf_counter()
    call = (mod.worker, spec.world_size, spec.to_dict(), points, args.steps)
    if args.loopback:
        from moesaic.comm.world import run_world

        per_rank = run_world(*call, timeout_s=1800.0)
    else:
        from moesaic.cluster import EmulatedCluster

        with EmulatedCluster(spec) as cluster:
            per_rank = cluster.run(*call, timeout_s=1800.0)
    rows = summarize(spec, per_rank)
    if args.trace:
        last = len(per_rank[0]["points"]) - 1
        write_chrome_trace(args.trace, [r["points"][last]["spans"] for r in per_rank])
    result = {
        "meta": run_metadata(),
        "wall_s": time.perf_counter() - start,
        "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "cluster": None if args.loopback else spec.to_dict(),
        "config": {
            "hidden_size": H,
            "num_experts": E,
            "top_k": K,
            "blocks": BLOCKS,
            "seq_len": SEQ,
            "heads": HEADS,
            "compression_ratio": COMPRESSION,
            "warmup": WARMUP,
            "rounds": args.steps,
            "dtype": "float32",
            "optimizer": "SGD",
            "flops_per_s_min_over_ranks": per_rank[0]["flops_per_s"],
        },
        "points": rows,
        # what summarize() read (per point: rounds x [variants..., compute only] seconds, the
        # observed rows per layer), so the summary can be recomputed from this file
        "raw": [{k: v for k, v in p.items() if k != "spans"} for p in per_rank[0]["points"]],
        "flops_per_s": per_rank[0]["flops_per_s"],
    }
    result["model_error_summary"] = _error_summary(rows)
    print(_table(rows))
    print(json.dumps(result["model_error_summary"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
