"""Round-robin timing of one MoE layer's strategies on an emulated cluster, forward and backward
timed apart, with the bytes each sends counted (shared by ``taskflow_table3.py`` and
``flashdmoe_sweeps.py``).

One world per EP size; in it, for each :class:`Point` (a layer shape and a routing), every
variant in ``VARIANTS`` builds its layer (all from seed 0: the same router and experts), and each
round times every variant once, a barrier before each phase, so noise hits all alike. A phase's
time is the slowest rank's (all-reduce MAX). Variants:

* ``dropless``: all-to-all-v of the exact rows, grouped experts, all-to-all-v back;
* ``padded``: capacity all-to-all, every (source rank, expert) slot padded to the group's largest
  load (no capacity factor, so nothing is dropped and the work equals dropless');
* ``taskflow static`` (HyperParallel-MoE: compiled order, RATR on), ``taskflow static, no RATR``
  (the same plans compiled with ``CompileOptions(ratr=False)``), ``taskflow dynamic`` (FlashDMoE:
  scheduler and processor pool), ``taskflow static, tile 512`` (``tile_m`` 512 instead of 128):
  tile plans with one-sided puts, ``TaskflowOptions`` defaults otherwise;
* ``compute only``: ``dropless`` with every expert on this rank (a solo group): no byte moves;
* ``comm only``: ``dropless``' exact exchanges with the experts replaced by the identity.

The perfect-overlap bound of a phase is ``max(compute only, comm only)`` of that phase.

Routing: ``balanced`` gives token t the experts ``(t*K + k) % E`` (every (source rank, expert)
pair gets exactly T*K/E rows, HyperParallel-MoE's forced balanced routing); ``router`` uses the
layer's own gate on the random input (FlashDMoE's natural routing: the loads are whatever the
untrained gate gives). Every variant of a point runs the same routing.

Bytes, counted two ways per step (fwd + bwd when the backward runs), both per rank:

* ``wire``: the rank's ``eth0`` transmit counter (``/proc/self/net/dev`` inside the rank's
  network namespace, the kernel's count: payload, TCP/IP headers, acks), read right after the
  barrier that opens each step (every byte of the previous step has then been received), minus
  the barriers' own bytes (measured once per world);
* ``payload``: the bytes the strategy's collectives and puts sent to other ranks
  (``EPGroup.traffic``, the library's own accounting of every message).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

VARIANTS = (
    "dropless",
    "padded",
    "taskflow static",
    "taskflow static, no RATR",
    "taskflow dynamic",
    "taskflow static, tile 512",
    "compute only",
    "comm only",
)
# the taskflow variants' options (``TaskflowOptions``; defaults otherwise)
TASKFLOW_OPTIONS = {
    "taskflow static": {"executor": "static"},
    "taskflow static, no RATR": {"executor": "static"},  # + CompileOptions(ratr=False)
    "taskflow dynamic": {"executor": "dynamic"},
    "taskflow static, tile 512": {"executor": "static", "tile_m": 512},
}
TIMED_TASKFLOW = tuple(TASKFLOW_OPTIONS)


@dataclass(frozen=True)
class Point:
    """One measured configuration: a layer shape, its tokens per rank and its routing."""

    name: str
    tokens: int  # per rank
    hidden: int
    ffn: int
    experts: int
    top_k: int
    routing: str = "balanced"  # or "router"
    backward: bool = True


def _tx_bytes() -> int:
    """This network namespace's ``eth0`` transmitted bytes (the kernel's counter)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0  # loopback world: no emulated interface


def _layer(p: Point, variant: str, group: Any = None) -> Any:
    import torch

    from moesaic import MoEConfig, MoELayer
    from moesaic.taskflow.bucket import CompileOptions

    dispatcher = {"padded": "padded"}.get(variant, "dropless")
    options = TASKFLOW_OPTIONS.get(variant)
    if options is not None:
        dispatcher = "taskflow"
    cfg = MoEConfig(
        hidden_size=p.hidden,
        ffn_hidden_size=p.ffn,
        num_experts=p.experts,
        top_k=p.top_k,
        dispatcher=dispatcher,
        options=options,
        collective_timeout_s=300.0,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg, group=group)
    if variant == "taskflow static, no RATR":  # compiled at the first step: before it
        rt = layer.strategy.runtime
        rt.options = CompileOptions(
            ratr=False, interleave=rt.options.interleave, pipeline=rt.options.pipeline
        )
    return layer


def _routing(p: Point, x: Any, layer: Any) -> tuple[Any, Any]:
    """(top-k ids, top-k weights) of this rank's tokens."""
    import torch

    T, K, E = p.tokens, p.top_k, p.experts
    if p.routing == "balanced":
        if K > E or (T * K) % E:
            raise ValueError(f"balanced routing needs top_k <= experts and E | T*K ({p})")
        ids = (torch.arange(T * K) % E).view(T, K)
        return ids, torch.full((T, K), 1.0 / K)
    with torch.no_grad():
        plan = layer.route(x).plan
    layer.take_stats()
    return plan.topk_ids_TK.clone(), plan.topk_weights_TK.detach().clone()


def measure_point(
    p: Point, variants: tuple[str, ...], rounds: int, warmup: int, barrier_bytes: float
) -> dict[str, Any]:
    """Every variant of one point, round-robin; times are the slowest rank's."""
    import torch
    import torch.distributed as dist

    from moesaic.comm.collectives import EPGroup
    from moesaic.routing import build_plan
    from moesaic.strategies.base import StrategyContext
    from moesaic.strategies.dropless import DroplessStrategy

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(p.tokens, p.hidden, generator=gen)
    g = torch.randn(p.tokens, p.hidden, generator=gen)
    alone = dist.new_group([rank], use_local_synchronization=True)
    layers = {
        v: _layer(p, v, group=alone if v == "compute only" else None)
        for v in variants
        if v != "comm only"
    }
    base = layers.get("dropless") or _layer(p, "dropless")
    ids, weights = _routing(p, x, base)
    placements = {v: lay.strategy.routing_placement for v, lay in layers.items()}
    identity = None
    if "comm only" in variants:
        identity = DroplessStrategy(StrategyContext(base.config, EPGroup(None, 300.0),
                                                    base.placement))  # fmt: skip
        placements["comm only"] = base.strategy.routing_placement

    def traffic(v: str) -> int:
        strat = identity if v == "comm only" else layers[v].strategy
        assert strat is not None
        return sum(strat.ctx.group.traffic.peer_bytes_P)

    def step(v: str) -> tuple[float, float, int, float]:
        dist.barrier()
        sent0 = traffic(v)
        c0 = time.process_time()
        xi = x.clone().requires_grad_(p.backward)
        w = weights.clone().requires_grad_(p.backward)
        plan = build_plan(ids, w, placements[v])  # weights in this step's graph
        grad_ctx = torch.enable_grad() if p.backward else torch.no_grad()
        t0 = time.perf_counter()
        with grad_ctx:
            if v == "comm only":
                assert identity is not None
                y = identity.forward(xi, plan, lambda rows, counts: rows * 1.0).y_TH
            else:
                y = layers[v].strategy.forward(xi, plan, layers[v].experts).y_TH
        fwd = time.perf_counter() - t0
        bwd = 0.0
        if p.backward:
            dist.barrier()
            t0 = time.perf_counter()
            y.backward(g)
            bwd = time.perf_counter() - t0
        return fwd, bwd, traffic(v) - sent0, time.process_time() - c0

    # tx read right after each step's opening barrier: the step's bytes are the next reading's
    # difference, minus the barriers in between (one per phase)
    barriers = 2 if p.backward else 1
    order = [v for _ in range(warmup + rounds) for v in variants]
    fwd_s: dict[str, list[float]] = {v: [] for v in variants}
    bwd_s: dict[str, list[float]] = {v: [] for v in variants}
    payload: dict[str, list[int]] = {v: [] for v in variants}
    wire: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    prev_tx = _tx_bytes()
    for i, v in enumerate(order):
        f, b, sent, c = step(v)
        dist.barrier()
        tx = _tx_bytes()
        if i >= warmup * len(variants):
            fwd_s[v].append(f)
            bwd_s[v].append(b)
            payload[v].append(sent)
            cpu[v].append(c)
            wire[v].append(tx - prev_tx - barriers * barrier_bytes - barrier_bytes)
        prev_tx = tx
    times = torch.tensor([[fwd_s[v][r], bwd_s[v][r]] for r in range(rounds) for v in variants])
    fastest = times.clone()
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
    t = times.view(rounds, len(variants), 2)
    skew = (times - fastest).view(rounds, len(variants), 2)
    info: dict[str, Any] = {}
    for v in TIMED_TASKFLOW:
        if v in layers:
            rt = layers[v].strategy.runtime
            fwd_plan, _ = next(iter(rt._plans.values()))
            info[v] = {"bucket": fwd_plan.bucket.to_dict(), "options": rt.options.to_dict()}
    loads = torch.bincount(ids.reshape(-1), minlength=p.experts)
    dist.all_reduce(loads)
    return {
        "point": asdict(p),
        "ranks": dist.get_world_size(),
        "variants": list(variants),
        "fwd_s": {v: t[:, i, 0].tolist() for i, v in enumerate(variants)},
        "bwd_s": {v: t[:, i, 1].tolist() for i, v in enumerate(variants)},
        # slowest minus fastest rank of a phase (each rank's clock starts at the same barrier)
        "rank_skew_s": {
            v: {"forward": skew[:, i, 0].tolist(), "backward": skew[:, i, 1].tolist()}
            for i, v in enumerate(variants)
        },
        "cpu_s": {v: statistics.median(cpu[v]) for v in variants},
        "payload_bytes": {v: statistics.median(payload[v]) for v in variants},
        "wire_bytes": {v: statistics.median(wire[v]) for v in variants},
        "expert_load_max_over_mean": float(loads.max()) / float(loads.float().mean()),
        "taskflow": info,
    }


def worker(
    rank: int, world: int, points: list[Point], variants: tuple[str, ...], rounds: int, warmup: int
) -> list[dict[str, Any]]:
    """Every point on this rank; returns per point its measurement (all ranks' bytes)."""
    import torch
    import torch.distributed as dist

    from moesaic.bench.allocator import retain_freed_memory

    torch.set_num_threads(1)  # 2 cores: one thread per rank is the share (or more than it)
    retain_freed_memory()
    # the barriers' own bytes on the wire: 8 barriers, their median difference
    readings = []
    for _ in range(9):
        dist.barrier()
        readings.append(_tx_bytes())
    barrier_bytes = statistics.median(b - a for a, b in itertools.pairwise(readings))
    out = []
    for p in points:
        res = measure_point(p, variants, rounds, warmup, barrier_bytes)
        gathered: list[Any] = [None] * world
        mine = {k: res.pop(k) for k in ("payload_bytes", "wire_bytes", "cpu_s")}
        dist.all_gather_object(gathered, mine)
        for k in mine:  # per rank, e.g. "cpu_s_per_rank": the process CPU seconds of a step
            res[f"{k}_per_rank"] = [g[k] for g in gathered]
        res["barrier_wire_bytes"] = barrier_bytes
        out.append(res)
    return out


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Medians, bounds and per-round ratios of one point's measurement."""
    v = res["variants"]
    fwd, bwd = res["fwd_s"], res["bwd_s"]
    tot = {n: [a + b for a, b in zip(fwd[n], bwd[n])] for n in v}
    med = {
        phase: {n: statistics.median(d[n]) for n in v}
        for phase, d in (("forward", fwd), ("backward", bwd), ("total", tot))
    }
    out: dict[str, Any] = {"median_s": med}
    if "compute only" in v and "comm only" in v:
        out["bound_s"] = {ph: max(m["compute only"], m["comm only"]) for ph, m in med.items()}
    if "dropless" in v:
        phases = {"forward": fwd, "backward": bwd, "total": tot}
        out["speedup_vs_dropless"] = {
            ph: {
                n: statistics.median(a / b for a, b in zip(d["dropless"], d[n]) if b > 0)
                for n in v
                if n not in ("dropless", "compute only", "comm only") and any(d[n])
            }
            for ph, d in phases.items()
        }
    if "taskflow static" in v and "taskflow static, no RATR" in v:
        out["ratr_speedup"] = {
            ph: statistics.median(
                a / b for a, b in zip(d["taskflow static, no RATR"], d["taskflow static"]) if b > 0
            )
            for ph, d in (("forward", fwd), ("backward", bwd), ("total", tot))
            if any(d["taskflow static"])
        }
    out["payload_bytes_mean_rank"] = {
        n: statistics.mean(r[n] for r in res["payload_bytes_per_rank"]) for n in v
    }
    out["wire_bytes_mean_rank"] = {
        n: statistics.mean(r[n] for r in res["wire_bytes_per_rank"]) for n in v
    }
    out["cpu_s_mean_rank"] = {n: statistics.mean(r[n] for r in res["cpu_s_per_rank"]) for n in v}
    out["rank_skew_median_s"] = {
        n: {ph: statistics.median(x) for ph, x in d.items()} for n, d in res["rank_skew_s"].items()
    }
    return out


def run_ep(
    ep: int,
    gbps: float,
    latency_ms: float,
    points: list[Point],
    variants: tuple[str, ...],
    rounds: int,
    warmup: int,
    loopback: bool = False,
) -> list[dict[str, Any]]:
    """Every point in one world of ``ep`` ranks on one shaped link level (all ranks under one
    switch: each rank's link is shaped both ways, so puts to one rank share its port)."""
    import taskflow_harness as mod  # workers unpickle the function by this module name

    from moesaic.cluster.spec import ClusterSpec

    call = (mod.worker, ep, points, variants, rounds, warmup)
    if loopback:
        from moesaic.comm.world import run_world

        return run_world(*call, timeout_s=3600.0)[0]
    from moesaic.cluster import EmulatedCluster

    spec = ClusterSpec.from_dict({
        "name": f"seeds_{ep}rank", "world_size": ep,
        "levels": [{"name": "rank", "size": ep, "bandwidth_gbps": gbps,
                    "latency_ms": latency_ms}],
    })  # fmt: skip
    with EmulatedCluster(spec) as cluster:
        return cluster.run(*call, timeout_s=3600.0)[0]


class RunRecord:
    """What every result of these scripts records around its measurements: the run's metadata,
    its wall time, the load average before and after, and the settings each fixes (fp32, one
    torch thread per rank, ``--quick`` or not). Opened before the first measurement."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.load_before = os.getloadavg()
        self.start = time.perf_counter()

    def save(self, result: dict[str, Any], out: str | None, default: Path) -> None:
        """Write ``result`` to ``out``, or to ``default`` unless the run is ``--quick`` (a
        quick run's numbers are a smoke test, never the committed result)."""
        path = Path(out) if out else (None if self.quick else default)
        if path is not None:
            path.write_text(json.dumps(result, indent=1) + "\n")

    def result(self, config: dict[str, Any], **body: Any) -> dict[str, Any]:
        """The result: this record, the script's ``config`` and its ``body`` fields."""
        from moesaic.bench.meta import run_metadata

        return {
            "meta": run_metadata(),
            "wall_s": time.perf_counter() - self.start,
            "load_average_1_5_15": {"before": self.load_before, "after": os.getloadavg()},
            "config": {
                **config,
                "dtype": "float32",
                "torch_threads_per_rank": 1,
                "quick": self.quick,
            },
            **body,
        }
