"""``moesaic bench layer``: forward+backward throughput and bytes of the dispatchers.

The moesaic strategies asked for (default: every registered one that runs without a cluster
description, ``bench_strategies``), the peers asked for
(``--peers torchtitan,deepspeed``, see ``moesaic.bench.peers``: same weights, outputs and
gradients checked against ours before timing) and, at EP = 1, transformers' Mixtral block run
interleaved, round by round, in one process per rank, so their ratios are measured side by side.
For EP = 2 and 4 everything runs on a gloo world of that size (one thread per rank; on a 2-core
machine EP = 4 is oversubscribed and says so in the result). Bytes are what each rank sent
to other ranks per forward (dispatch + combine payload, plus metadata), at uniform and at skewed
routing. With shared experts (``num_shared_experts``, ``--shared-experts``) every layer has
them, the torchtitan peer too (same weights); the Mixtral block and deepspeed have none.

The physical bound reported beside the throughput is the expert matmul FLOPs of a step divided by
the single-thread fp32 GEMM rate measured in the same run.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from moesaic.bench.allocator import retain_freed_memory
from moesaic.bench.meta import run_metadata, summarize, time_calls
from moesaic.bench.options import available_cores, write_json
from moesaic.bench.peers import PEERS, PeerModule, build_peer, compare, counterpart_config
from moesaic.checks import check_int, check_number, check_one_of, check_positive, check_positive_int
from moesaic.comm.collectives import EPGroup
from moesaic.comm.world import run_world
from moesaic.config import MoEConfig
from moesaic.layer import LayerStats, MoELayer, aux_loss
from moesaic.strategies import get_strategy, strategy_names

ROUTINGS = ("uniform", "skewed")
# Deadline of every collective of a benchmark world (its layers' and its own agreements).
COLLECTIVE_TIMEOUT_S = 120.0


def bench_strategies() -> tuple[str, ...]:
    """Every registered strategy that can run in this benchmark: the layers get no cluster
    description, so those that need one (``needs_topology``) are left out."""
    return tuple(n for n in strategy_names() if not get_strategy(n).needs_topology)


@dataclass(kw_only=True, slots=True)
class LayerBench:
    """What to measure. Defaults: a small Mixtral-shaped layer a CPU steps in ~0.1 s."""

    hidden_size: int = 256
    ffn_hidden_size: int = 512
    num_experts: int = 8
    top_k: int = 2
    # Shared experts every token passes through (MoEConfig.num_shared_experts; replicated), each
    # of width shared_expert_hidden_size (None: ffn_hidden_size). The transformers Mixtral
    # block has none (with_transformers must be False) nor has the deepspeed peer.
    num_shared_experts: int = 0
    shared_expert_hidden_size: int | None = None
    tokens_per_rank: int = 1024
    ep_sizes: tuple[int, ...] = (1, 2, 4)
    iters: int = 8
    warmup: int = 2
    # Skewed routing: a constant input channel and a router column that favours low expert ids
    # by this many logits per expert id (gives a max/mean expert load of ~3 at the defaults).
    skew_logits_per_expert: float = 0.5
    with_transformers: bool = True
    # moesaic strategies timed; default: every registered one that can run here.
    strategies: tuple[str, ...] = field(default_factory=lambda: bench_strategies())
    # Other libraries' layers timed beside ours (moesaic.bench.peers.PEERS), when installed.
    peers: tuple[str, ...] = ()
    # Capacity factor of the padded layer compared with DeepSpeed (and of DeepSpeed's layer).
    capacity_factor: float = 1.25
    # Largest relative difference of a peer's output or gradients from ours before timing.
    check_tolerance: float = 1e-4
    # Keep freed memory in every benchmark process (glibc mallopt, moesaic.bench.allocator):
    # without it each step page-faults its activations in afresh, and in interleaved rounds a
    # module pays for the allocation pattern of the one before it.
    retain_freed_memory: bool = True
    seed: int = 0
    # A cluster description (TOML path): run the EP worlds in its emulated network namespaces.
    # Only EP = its world size then; needs root (see docs/cluster.md).
    cluster: str | None = None

    def __post_init__(self) -> None:
        MoEConfig(**self._layer_fields("dropless"))  # validate the shape early
        check_positive_int("tokens_per_rank", self.tokens_per_rank)
        check_positive_int("iters", self.iters)
        check_int("warmup", self.warmup, minimum=0)
        if not self.strategies:
            raise ValueError("strategies must name at least one moesaic strategy")
        for i, name in enumerate(self.strategies):
            check_one_of(f"strategies[{i}]", name, strategy_names())
        for i, name in enumerate(self.peers):
            check_one_of(f"peers[{i}]", name, PEERS)
        if self.shared_expert_hidden_size is not None and not self.num_shared_experts:
            raise ValueError(
                "shared_expert_hidden_size needs num_shared_experts > 0 (--shared-experts), "
                f"got {self.shared_expert_hidden_size} with 0"
            )
        if self.num_shared_experts:
            if self.with_transformers:
                raise ValueError(
                    "with_transformers needs num_shared_experts 0: the transformers Mixtral "
                    f"block has no shared experts (got {self.num_shared_experts})"
                )
            if "deepspeed" in self.peers:
                raise ValueError(
                    "the deepspeed peer needs num_shared_experts 0: its MoE has no shared "
                    f"experts (got {self.num_shared_experts})"
                )
        check_positive("capacity_factor", self.capacity_factor)
        check_number("check_tolerance", self.check_tolerance)
        check_positive("check_tolerance", self.check_tolerance)
        if not self.ep_sizes:
            raise ValueError("ep_sizes must name at least one EP size")
        for i, ep in enumerate(self.ep_sizes):
            check_positive_int(f"ep_sizes[{i}]", ep)
            if self.num_experts % ep:
                raise ValueError(
                    f"num_experts ({self.num_experts}) must be divisible by every ep size "
                    f"(got {ep})"
                )
        if self.cluster is not None:
            from moesaic.cluster.spec import ClusterSpec

            world = ClusterSpec.from_toml(self.cluster).world_size
            if tuple(self.ep_sizes) != (world,):
                raise ValueError(
                    f"ep sizes ({','.join(map(str, self.ep_sizes))}) must be exactly the "
                    f"cluster's world size ({world}) when a cluster is given"
                )

    def _layer_fields(self, dispatcher: str) -> dict:
        return {
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_shared_experts": self.num_shared_experts,
            "shared_expert_hidden_size": self.shared_expert_hidden_size,
            "dispatcher": dispatcher,
            "collective_timeout_s": COLLECTIVE_TIMEOUT_S,
        }


def _layer(bench: LayerBench, dispatcher: str, routing: str, **overrides) -> MoELayer:
    torch.manual_seed(bench.seed)
    config = MoEConfig(**{**bench._layer_fields(dispatcher), **overrides})
    layer = MoELayer(config)
    if routing == "skewed":
        with torch.no_grad():
            ids = torch.arange(bench.num_experts, dtype=torch.float32)
            layer.router.weight[:, 0] = -bench.skew_logits_per_expert * ids
    return layer


def _inputs(bench: LayerBench, routing: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(bench.seed * 1000 + rank)
    # [1, T, H]: the transformers block wants (batch, seq, hidden).
    x = torch.randn(1, bench.tokens_per_rank, bench.hidden_size, generator=gen)
    if routing == "skewed":
        x[..., 0] = 1.0
    return x, torch.randn(x.shape, generator=gen)


def _train_step(module, x: torch.Tensor, g: torch.Tensor) -> None:
    """One timed step: forward, the loss a user of that library writes, backward, and the
    weights marked changed as an optimizer step would (an in-place no-op): what a strategy
    caches per weight version (``hybrid``'s gathered experts) is redone every step, as in
    training."""
    x = x.detach().requires_grad_()
    y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    loss = (y * g).sum()
    if isinstance(module, MoELayer):
        loss = loss + aux_loss(module)
    elif isinstance(module, PeerModule):
        extra = module.loss_terms()
        if extra is not None:
            loss = loss + extra
    loss.backward()
    module.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0)  # bumps the version counter, as the optimizer's in-place update does


def _check_step(module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward+backward of the output alone (no aux loss): returns ``(y, dx)``, keeps grads."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = module(x)
    (y * g).sum().backward()
    if isinstance(module, MoELayer):
        module.take_aux_terms()  # this check's aux terms are not part of any timed step
    elif isinstance(module, PeerModule):
        module.loss_terms()
    assert x.grad is not None
    return y.detach(), x.grad


def _modules(bench: LayerBench, routing: str, world: int) -> tuple[dict, dict]:
    """Everything timed on this rank for one routing: ``{name: module}`` in timing order, and
    each peer's agreement with its moesaic counterpart (checked here, before any timing)."""
    group = EPGroup(None, COLLECTIVE_TIMEOUT_S)
    ours: dict[str, MoELayer] = {d: _layer(bench, d, routing) for d in bench.strategies}
    modules: dict[str, torch.nn.Module] = dict(ours)
    checks: dict[str, dict] = {}
    x, g = _inputs(bench, routing, torch.distributed.get_rank() if world > 1 else 0)
    for name in bench.peers:
        ours_name = _counterpart_name(name, bench)
        if ours_name not in ours:
            base = MoEConfig(**bench._layer_fields("dropless"))
            cfg = counterpart_config(name, base, bench.capacity_factor)
            semantics = ("capacity_factor", "renormalize_after_drop", "balance_loss_choices")
            overrides = {f: getattr(cfg, f) for f in semantics}
            ours[ours_name] = _layer(bench, cfg.dispatcher, routing, **overrides)
            modules[ours_name] = ours[ours_name]
        peer = build_peer(name, ours[ours_name], bench.capacity_factor)
        agreement = compare(peer, ours[ours_name], x, g, _check_step)
        checks[name] = {"counterpart": ours_name, **asdict(agreement)}
        # Every rank decides alike, so none is left waiting in a collective.
        worst = group.control_tensor([agreement.worst], torch.float64)
        group.all_reduce(worst, torch.distributed.ReduceOp.MAX, f"peer {name} agreement")
        if not worst.item() <= bench.check_tolerance:
            raise RuntimeError(
                f"peer {name} disagrees with moesaic {ours_name} on {routing} routing: worst "
                f"relative difference {worst.item():.2e} over the ranks (this rank: "
                f"{agreement}), tolerance {bench.check_tolerance}; not timing it"
            )
        modules[name] = peer
    if world == 1 and bench.with_transformers:
        from moesaic.interop.hf import mixtral_block_from_layer

        dropless = ours.get("dropless") or _layer(bench, "dropless", routing)
        modules["transformers-mixtral"] = mixtral_block_from_layer(dropless).train()
    return modules, checks


def _counterpart_name(peer: str, bench: LayerBench) -> str:
    """Our impl a peer is compared with: dropless, or padded at the bench's capacity factor."""
    return "dropless" if peer == "torchtitan" else f"padded-cf{bench.capacity_factor:g}"


def _interleaved(bench: LayerBench, modules: dict, x: torch.Tensor, g: torch.Tensor) -> dict:
    """Step times of every module, round by round (the machine's noise hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(bench.warmup):
        for module in modules.values():
            _train_step(module, x, g)
    for _ in range(bench.iters):
        for name, module in modules.items():
            times[name] += time_calls(partial(_train_step, module, x, g), 1, 0)
    return times


def _expert_flops(bench: LayerBench, tokens: int) -> float:
    """fwd+bwd matmul FLOPs of the experts: 3 GEMMs of 2*H*F per routed row, x3 for backward,
    and as many of 2*H*S*Fs per token for the shared experts (their gate's GEMV left out)."""
    shared = bench.num_shared_experts * (bench.shared_expert_hidden_size or bench.ffn_hidden_size)
    width = bench.ffn_hidden_size * bench.top_k + shared
    return 3 * 3 * 2 * bench.hidden_size * width * tokens


def _gemm_gflops(bench: LayerBench) -> float:
    """Single-thread fp32 GEMM rate at the expert shape, the compute bound of this machine."""
    rows = bench.tokens_per_rank * bench.top_k // bench.num_experts or 1
    a = torch.randn(rows, bench.hidden_size)
    b = torch.randn(bench.hidden_size, bench.ffn_hidden_size)
    times = time_calls(lambda: a @ b, iters=20, warmup=3)
    return 2 * rows * bench.hidden_size * bench.ffn_hidden_size / sorted(times)[10] / 1e9


def _per_forward(stats: LayerStats) -> tuple[torch.Tensor, dict]:
    """Counts per expert and communication of one forward, from the sum over identical ones."""
    n = stats.forwards
    assert stats.counts_E is not None and n > 0
    comm = stats.comm
    return stats.counts_E // n, {
        "bytes_per_forward": comm.total_bytes // n,
        "payload_bytes": (comm.dispatch_bytes + comm.combine_bytes) // n,
        "padded_rows": int(comm.padded_rows) // n,  # a 0-d tensor when it stayed on the device
        "collectives": comm.collectives // n,
        "peer_bytes_P": [b // n for b in comm.peer_bytes_P],
    }


def _load_stats(counts_E: torch.Tensor) -> dict:
    mean = counts_E.float().mean().item()
    return {"max_over_mean": counts_E.max().item() / mean if mean else 0.0}


def ep_worker(rank: int, world: int, bench: LayerBench) -> dict:
    """One rank of an EP world (or the one process at EP = 1): every module of every routing,
    interleaved round by round; step times, bytes, loads and the peers' agreement checks."""
    torch.set_num_threads(1)
    if bench.retain_freed_memory:
        retain_freed_memory()
    out = {}
    group = EPGroup(None, COLLECTIVE_TIMEOUT_S)
    for routing in ROUTINGS:
        x, g = _inputs(bench, routing, rank)
        modules, checks = _modules(bench, routing, world)
        ours = {n: m for n, m in modules.items() if isinstance(m, MoELayer)}
        before = {n: m.ep.traffic.collectives for n, m in ours.items()}
        times = _interleaved(bench, modules, x, g)
        for name, module in modules.items():
            entry: dict = {"times": times[name]}
            if isinstance(module, MoELayer):
                counts, stats = _per_forward(module.take_stats())
                counts = group.all_reduce(counts.to(group.control_device), what="expert loads")
                del stats["collectives"]  # the forward's; a step's are counted instead
                entry.update(stats)
                # what the layer's group issued in the timed steps (forward and backward: the
                # backward's all-to-alls, hybrid's gradient reduces), per step
                issued = module.ep.traffic.collectives - before[name]
                steps = bench.warmup + bench.iters
                entry["collectives_per_step"] = issued // steps if world > 1 else 0
                entry["load"] = _load_stats(counts)
            if name in checks:
                entry["check"] = checks[name]
            out[f"{name}/{routing}"] = entry
    return out


def _on_cluster(bench: LayerBench):
    """Run the EP world in the emulated cluster; also return its ClusterSpec."""
    from moesaic.cluster import ClusterSpec, EmulatedCluster

    assert bench.cluster is not None  # run() comes here only with a cluster
    spec = ClusterSpec.from_toml(bench.cluster)
    with EmulatedCluster(spec) as cluster:
        # The launchers share one signature: ep_worker runs as under run_world.
        per_rank = cluster.run(ep_worker, spec.world_size, bench, timeout_s=1800)
    return per_rank, spec


def _network_bound_ms(per_rank: list[dict], key: str, spec) -> float:
    """A step's lower bound on the emulated network (forward + backward), milliseconds.

    ``moesaic.cluster.cost.traffic_time_s`` of the step's per-peer bytes (each forward
    all-to-all is mirrored by one in the backward: twice the forward's ``peer_bytes_P``) with
    the step's collectives: the busiest uplink of any level plus collectives x latency.
    """
    from moesaic.cluster.cost import traffic_time_s

    bytes_PP = [[2 * b for b in r[key]["peer_bytes_P"]] for r in per_rank]
    collectives = max(r[key]["collectives_per_step"] for r in per_rank)
    return traffic_time_s(spec, bytes_PP, collectives=collectives) * 1e3


def run(bench: LayerBench) -> dict:
    """Measure everything; returns the result document (see ``format_table``)."""
    torch.set_num_threads(1)  # one thread per rank everywhere, so EP sizes compare fairly
    load_before = _load_avg()
    retained = retain_freed_memory() if bench.retain_freed_memory else False
    gflops = _gemm_gflops(bench)
    rows = []
    network = None
    for ep in _progress(bench.ep_sizes, "EP sizes"):
        if bench.cluster is not None:
            per_rank, network = _on_cluster(bench)
        elif ep == 1:
            per_rank = [ep_worker(0, 1, bench)]
        else:
            per_rank = run_world(ep_worker, ep, bench, timeout_s=600, pg_timeout_s=300)
        for key in per_rank[0]:
            name, routing = key.split("/")
            # Ranks step in lockstep (the all-to-alls synchronise them): the slowest is the step.
            medians = [summarize(r[key]["times"]) for r in per_rank]
            step = max(medians, key=lambda m: m["median_ms"])
            # Round by round, the slowest rank's time (rounds are interleaved across modules).
            step["round_ms"] = [1e3 * max(t) for t in zip(*(r[key]["times"] for r in per_rank))]
            tokens = bench.tokens_per_rank * ep
            row = {
                "ep": ep,
                "impl": name,
                "routing": routing,
                "step": step,
                "tokens_per_s": tokens / (step["median_ms"] / 1e3),
                "expert_gflops_achieved": _expert_flops(bench, tokens) / step["median_ms"] / 1e6,
                "bound_tokens_per_s": tokens
                / (_expert_flops(bench, tokens) / (gflops * 1e9 * min(ep, _cores()))),
            }
            row["fraction_of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
            for field_name in (
                "bytes_per_forward",
                "payload_bytes",
                "padded_rows",
                "load",
                "check",
            ):
                if field_name in per_rank[0][key]:
                    row[field_name] = per_rank[0][key][field_name]
            if "bytes_per_forward" in row:
                row["bytes_per_forward_all_ranks"] = sum(
                    r[key]["bytes_per_forward"] for r in per_rank
                )
            if network is not None:
                row["network_bound_ms"] = _network_bound_ms(per_rank, key, network)
            rows.append(row)
    _add_ratios(rows, bench)
    return {
        "benchmark": "moesaic bench layer",
        "meta": run_metadata(),
        # The machine may be shared: 1/5/15-minute load averages before and after the run.
        "load_avg_before_after": [load_before, _load_avg()],
        "allocator": "glibc, freed memory retained (moesaic.bench.allocator)"
        if retained
        else "default",
        "config": asdict(bench),
        "gemm_gflops_single_thread": gflops,
        "oversubscribed_ep_sizes": [ep for ep in bench.ep_sizes if ep > _cores()],
        "network": network.to_dict() if network else "loopback (no emulated cluster)",
        "rows": rows,
    }


def _progress(items, desc: str):
    """A tqdm bar on a terminal when tqdm is installed (the bench extra); plain iteration else."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, unit="world", leave=False, disable=None)  # None: not a tty


def _load_avg() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _cores() -> int:
    return available_cores()


def _add_ratios(rows: list[dict], bench: LayerBench) -> None:
    """Throughput relative to the transformers block (EP = 1), padded/dropless bytes, and each
    peer's step time over its moesaic counterpart's (``speedup_vs_<peer>`` on our row: > 1 means
    ours is faster), same EP size and routing, same run."""
    by_key = {(r["ep"], r["impl"], r["routing"]): r for r in rows}
    for peer in bench.peers:
        ours_name = _counterpart_name(peer, bench)
        for r in rows:
            theirs = by_key.get((r["ep"], peer, r["routing"]))
            if r["impl"] == ours_name and theirs:
                r[f"speedup_vs_{peer}"] = theirs["step"]["median_ms"] / r["step"]["median_ms"]
                # Paired: the median over rounds of that round's ratio (both ran back to back
                # in each round, so a slow spell of the machine hits both): the steadier figure.
                paired = [a / b for a, b in zip(theirs["step"]["round_ms"], r["step"]["round_ms"])]
                r[f"paired_speedup_vs_{peer}"] = sorted(paired)[len(paired) // 2]
    for r in rows:
        hf = by_key.get((1, "transformers-mixtral", r["routing"]))
        if hf:
            r["throughput_vs_transformers"] = r["tokens_per_s"] / hf["tokens_per_s"]
        dropless = by_key.get((r["ep"], "dropless", r["routing"]))
        if r["impl"] == "padded" and dropless and dropless.get("bytes_per_forward_all_ranks"):
            r["bytes_vs_dropless"] = (
                r["bytes_per_forward_all_ranks"] / dropless["bytes_per_forward_all_ranks"]
            )


def format_table(result: dict) -> str:
    head = (
        f"{'EP':>3} {'impl':<22} {'routing':<8} {'step ms':>9} {'tok/s':>9} "
        f"{'vs HF':>6} {'bound':>6} {'MB/fwd':>8} {'pad/drop':>8} {'load':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        mb = r.get("bytes_per_forward_all_ranks")
        lines.append(
            f"{r['ep']:>3} {r['impl']:<22} {r['routing']:<8} {r['step']['median_ms']:>9.1f} "
            f"{r['tokens_per_s']:>9.0f} {r.get('throughput_vs_transformers', float('nan')):>6.2f} "
            f"{r.get('fraction_of_bound', float('nan')):>6.2f} "
            f"{(mb / 1e6 if mb is not None else float('nan')):>8.2f} "
            f"{r.get('bytes_vs_dropless', float('nan')):>8.2f} "
            f"{r.get('load', {}).get('max_over_mean', float('nan')):>5.2f}"
        )
    for r in result["rows"]:
        for key, value in r.items():
            if key.startswith("speedup_vs_"):
                peer = key.removeprefix("speedup_vs_")
                lines.append(
                    f"EP {r['ep']} {r['routing']}: moesaic {r['impl']} is {value:.2f}x {peer} "
                    f"(ratio of median step times; paired per round "
                    f"{r[f'paired_speedup_vs_{peer}']:.2f}x)"
                )
    for r in result["rows"]:
        if "network_bound_ms" in r:
            lines.append(
                f"EP {r['ep']} {r['impl']}/{r['routing']}: network bound (busiest uplink + "
                f"collectives x latency) {r['network_bound_ms']:.1f} ms/step, measured "
                f"{r['step']['median_ms']:.1f}"
            )
    lines.append(
        f"bound: single-thread GEMM {result['gemm_gflops_single_thread']:.1f} GFLOP/s per core; "
        f"oversubscribed EP sizes: {result['oversubscribed_ep_sizes'] or 'none'}"
    )
    return "\n".join(lines)


def write(result: dict, path: str | Path) -> Path:
    """Write the result document to the file ``path``, atomically and with no leftovers."""
    return write_json(result, Path(path))
