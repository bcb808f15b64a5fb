"""``moesaic plan``: every runnable strategy x schedule x knobs for a model on a cluster, ranked.

Reads the cluster TOML of ``moesaic cluster`` (``--cluster``), the model (``--model``: the
simulator's model file or a training config, :func:`moesaic.train.model_files.load_model_spec`) and the
machine's rates (``--profile`` of ``moesaic calibrate``, or ``--flops-per-s``, or measured here
in about a second), and prints :func:`moesaic.planning.planner.plan_runs`'s ranking: a table of the
fastest ``--top`` combinations (strategy, schedule, R, Sp, domains, compression) with their
predicted step and perfect-overlap bound, the pick and the reason, and the pairs that cannot run
here with why. ``--json`` prints the ranking as a list of objects (``strategy``, ``schedule``,
``options``, ``predicted_ms``, ``bound_ms``, ...; the first also has ``reason``), which
``moesaic train --plan FILE.json`` trains with.

``--domains-only`` prints the earlier report instead: HybridEP's domain sizes alone, every
candidate priced by the stream cost model (``plan_domains``) and the training-step model of
``moesaic train --domains auto`` (:func:`build_plan`), from the training config's inputs
(``moesaic.train.domains``: tokens per MoE forward, the steady-state MoE block, fp32; a model
file plans as the training config of its model and batch, ``--dtype-bytes`` defaulting to its
``act_bytes``).

The cluster's ranks are the expert-parallel group (the TOML's ``nproc`` and ``ep`` are not
used). Torch-free, except when neither ``--profile`` nor ``--flops-per-s`` is given: the rates
are then measured with torch on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from moesaic.checks import check_number
from moesaic.cluster.spec import ClusterSpec
from moesaic.planning.plan_memory import add_memory_option, apply_memory, memory_lines
from moesaic.sim.hybrid_costmodel import DomainCandidate, DomainPlan, StreamInputs, plan_domains
from moesaic.simtools.cli_files import (
    add_all_reduce_option,
    add_loads_option,
    add_retime_option,
    apply_loads,
    check_profile,
    load_option,
    retimed,
)
from moesaic.train.model_files import load_model_spec
from moesaic.train.plan import ranking_json

PLAN_EPILOG = """\
examples:
  moesaic plan --cluster examples/clusters/flowmoe_2rank.toml \\
      --model examples/models/flowmoe_small.toml --profile profile.json
  moesaic plan --cluster examples/clusters/hybridep_1000dc.toml \\
      --model examples/models/hybridep_1000dc.toml --flops-per-s 1e14 --json > plan.json
  moesaic train --config examples/train_tiny.toml --plan plan.json
  moesaic plan --cluster examples/clusters/2dc_2node_small.toml \\
      --model examples/train_tiny.toml --domains-only   # HybridEP's domain sizes alone
"""

# Rows of the ranking's table by default (--top).
DEFAULT_TOP = 15


def add_subparser(subparsers) -> None:
    """Add ``plan`` to the top-level ``moesaic`` parser."""
    p = subparsers.add_parser(
        "plan",
        help="rank strategy x schedule x knobs for a model on a cluster (simulator)",
        description=(
            "Simulate every runnable combination of strategy, schedule and knobs (R, Sp, "
            "HybridEP domains, compression) of a model on a cluster and rank them by predicted "
            "step time; --domains-only prices HybridEP's domain sizes alone."
        ),
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--cluster", required=True, metavar="FILE.toml", help="cluster description (levels)"
    )
    p.add_argument(
        "--model",
        required=True,
        metavar="FILE.toml",
        help="training config (`moesaic train --config`) or model file (`moesaic simulate "
        "--model`), told apart by their keys",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--profile", metavar="FILE.json", help="machine profile (moesaic calibrate)")
    p.add_argument(
        "--allow-profile-mismatch",
        action="store_true",
        help="use a --profile measured on another cluster (its figures extrapolated)",
    )
    add_retime_option(p)
    p.add_argument(
        "--flops-per-s",
        type=float,
        metavar="X",
        help="a rank's matmul FLOP/s; with --profile, overrides its matmul rates (default: "
        "the profile's, or measured here with torch)",
    )
    p.add_argument(
        "--top",
        type=int,
        default=DEFAULT_TOP,
        metavar="N",
        help=f"rows of the ranking's table (default {DEFAULT_TOP}; --json lists every one)",
    )
    p.add_argument(
        "--compression-ratio",
        metavar="CR[,CR..]",
        help="hybrid's SR compression ratios of gathered experts to try (default: 1, exact; "
        "--domains-only: one, default the model's hybrid option compression_ratio)",
    )
    p.add_argument(
        "--capacity-factor",
        metavar="CF[,CF..]",
        help="also rank every combination with this capacity factor (each > 0): the "
        "assignments past ceil(CF x tokens x top_k / experts) per expert and source rank are "
        "dropped, a change of the model the planner makes only when asked; such entries carry "
        "the option capacity_factor, which `moesaic train --plan` sets (default: the model's "
        "own capacity only)",
    )
    p.add_argument(
        "--ep",
        metavar="auto|EP[,EP..]",
        help="also rank EP groups smaller than the world, the rest of it replicating the "
        "unsharded model (world / EP replicas; the gradients all-reduced after the backward): "
        "'auto' every size below the world dividing it and the experts, or a list; such "
        "entries carry the option ep, which `moesaic train --plan` sets (default: EP = the "
        "world only; needed where the experts are fewer than the ranks or do not divide them)",
    )
    add_all_reduce_option(p)
    add_loads_option(p)
    p.add_argument(
        "--measure-routing",
        action="store_true",
        help="price the job's own routing: run its router on its data first (a training config "
        "with data: 8 steps in one process, as `calibrate --model`; seconds for a small model); "
        "a model file has no data: routing stays uniform",
    )
    p.add_argument(
        "--domains-only",
        action="store_true",
        help="HybridEP's domain sizes alone, priced by the stream cost model (the earlier report)",
    )
    p.add_argument(
        "--tokens-per-rank",
        type=int,
        metavar="T",
        help="--domains-only: tokens per rank per MoE forward (default: batch_size x seq_len / "
        "pipeline_degree)",
    )
    p.add_argument(
        "--dtype-bytes",
        type=int,
        metavar="N",
        help="--domains-only: bytes per token element and weight (default: 4, moesaic train's "
        "fp32; a model file's act_bytes)",
    )
    add_memory_option(p)  # --memory-per-rank (planning.plan_memory)
    p.set_defaults(func=run_plan)


def _numbers(
    text: str | None, name: str, flag: str, lo: float, hi: float, *, lo_open: bool = False
) -> tuple[float, ...] | None:
    """``--flag X[,X..]``: comma-separated numbers, each in ``[lo, hi]`` (``(lo, hi]`` with
    ``lo_open``), errors naming ``name`` and the flag (None: not given)."""
    if text is None:
        return None
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{name} ({flag} {text!r}) must be numbers, comma-separated") from None
    for x in values:
        check_number(f"{name} ({flag})", x, lo, hi, lo_open=lo_open)
    return values


def _ratios(text: str | None) -> tuple[float, ...] | None:
    """``--compression-ratio CR[,CR..]``: each in [1, 1e6], the planner's rule (None: not
    given)."""
    return _numbers(text, "compression_ratio", "--compression-ratio", 1.0, 1e6)


def _capacities(text: str | None) -> tuple[float, ...]:
    """``--capacity-factor CF[,CF..]``: each in (0, 1e3], the model's rule (empty: not
    given)."""
    return _numbers(text, "capacity_factor", "--capacity-factor", 0.0, 1e3, lo_open=True) or ()


def _train_config(path: str) -> tuple[Any, int]:
    """``--model``'s training config (a model file's converted) and its default bytes per
    element."""
    from moesaic.sim.model import ModelSpec
    from moesaic.train.model_files import load_model, train_config_of

    model = load_model(path)
    if not isinstance(model, ModelSpec):
        return model, 4
    try:
        return train_config_of(model), model.act_bytes
    except ValueError as exc:
        raise ValueError(f"model file {path!r}: {exc}") from None


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--domains-only`` plan of ``args`` as plain data (what its ``--json`` prints)."""
    from moesaic.checks import check_positive, check_positive_int

    if args.loads is not None:
        raise ValueError("--loads applies to the ranking, not to --domains-only")
    if getattr(args, "capacity_factor", None) is not None:
        raise ValueError("--capacity-factor applies to the ranking, not to --domains-only")
    if getattr(args, "measure_routing", False):
        raise ValueError("--measure-routing applies to the ranking, not to --domains-only")
    from moesaic.train.domains import (
        dense_blocks_before,
        hybrid_options,
        model_stream_inputs,
        plan_training_domains,
        tokens_per_forward,
    )

    spec = load_option("cluster", args.cluster, ClusterSpec.from_toml)
    cfg, dtype_bytes = load_option("model", args.model, _train_config)
    if args.dtype_bytes is not None:
        dtype_bytes = args.dtype_bytes
    model = cfg.model
    tokens = args.tokens_per_rank
    if tokens is None:
        tokens = tokens_per_forward(cfg.batch_size, model.seq_len, int(cfg.pipeline_degree))
    check_positive_int("tokens_per_rank (--tokens-per-rank)", tokens)
    check_positive_int("dtype_bytes (--dtype-bytes)", dtype_bytes)
    measured = args.flops_per_s is None
    if measured:
        from moesaic.sim.hybrid_costmodel import measure_gemm_flops

        flops = measure_gemm_flops()
    else:
        flops = check_positive("flops_per_s (--flops-per-s)", args.flops_per_s)
    cr = hybrid_options(model.moe).compression_ratio
    ratios = _ratios(args.compression_ratio)
    if ratios is not None:
        if len(ratios) != 1:
            raise ValueError(
                f"--domains-only prices one compression ratio: --compression-ratio "
                f"{args.compression_ratio!r} gives {len(ratios)}"
            )
        cr = ratios[0]
    inputs = model_stream_inputs(
        model,
        tokens_per_rank=tokens,
        ep_size=spec.world_size,
        flops_per_s=flops,
        compression_ratio=cr,
        dtype_bytes=dtype_bytes,
    )
    plan = plan_domains(spec, inputs)
    step = plan_training_domains(
        model,
        spec,
        batch_size=cfg.batch_size,
        pipeline_degree=int(cfg.pipeline_degree),
        flops_per_s=flops,
    )
    moe = model.moe
    return {
        "cluster": {
            "file": args.cluster,
            "name": spec.name,
            "world_size": spec.world_size,
            "levels": [lv.name for lv in spec.levels],
            "level_sizes": [lv.size for lv in spec.levels],
        },
        "model": {
            "file": args.model,
            "hidden_size": moe.hidden_size,
            "ffn_hidden_size": moe.ffn_hidden_size,
            "num_experts": moe.num_experts,
            "top_k": moe.top_k,
            "activation": moe.activation,
            "tokens_per_rank": tokens,
            "seq_len": model.seq_len,
            "dense_blocks_before": dense_blocks_before(model),
            "dtype_bytes": dtype_bytes,
            "compression_ratio": cr,
        },
        "flops_per_s": flops,
        "flops_measured": measured,
        "inputs": _inputs_dict(inputs),
        "chosen": _candidate_dict(plan.chosen, plan),
        "classic": _candidate_dict(plan.classic, plan),
        "candidates": [_candidate_dict(c, plan) for c in plan.candidates],
        "reason": plan.reason,
        # what `moesaic train --domains auto` picks: a whole training step priced (forward,
        # backward, dense gradient reduce, prefetched gathers), moesaic.planning.stepmodel
        "training_step": {
            "domain_sizes": list(step.chosen.domain_sizes),
            "candidates": [
                {"domain_sizes": list(c.domain_sizes), "step_s": c.step_s} for c in step.candidates
            ],
            "reason": step.reason,
        },
    }


def _inputs_dict(inputs: StreamInputs) -> dict[str, Any]:
    return {
        "data_bytes": inputs.data_bytes,
        "expert_bytes": inputs.expert_bytes,
        "pre_expert_s": inputs.pre_expert_s,
        "experts_per_rank": inputs.experts_per_rank,
        "expert_s": inputs.expert_s,
    }


def _candidate_dict(c: DomainCandidate, plan: DomainPlan) -> dict[str, Any]:
    return {
        "domain_sizes": list(c.domain_sizes),
        "p": list(c.p),
        "ag_s": list(c.ag_s),
        "a2a_s": list(c.a2a_s),
        "predicted_s": c.final_s,
        "speedup_vs_classic": plan.classic.final_s / c.final_s,
        "chosen": c is plan.chosen,
    }


def _seq(values: list[float], fmt: str = "{:.3g}") -> str:
    return "[" + ", ".join(fmt.format(v) for v in values) + "]"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def format_plan(plan: dict[str, Any]) -> str:
    """The human-readable ``--domains-only`` report of :func:`build_plan`'s result."""
    c, m, i = plan["cluster"], plan["model"], plan["inputs"]
    sizes = " x ".join(f"{n} {s}" for n, s in zip(c["levels"], c["level_sizes"]))
    how = "measured here" if plan["flops_measured"] else "given"
    ch = plan["chosen"]
    lines = [
        f"cluster  {c['name']}: {c['world_size']} ranks = {sizes} (levels outermost first)",
        f"model    H={m['hidden_size']} F={m['ffn_hidden_size']} E={m['num_experts']} "
        f"K={m['top_k']} {m['activation']}; T={m['tokens_per_rank']} tokens per rank per MoE "
        f"forward; {m['dense_blocks_before']} dense block(s) before it; "
        f"{m['dtype_bytes']} bytes per element; CR {m['compression_ratio']:g}",
        f"inputs   D={_bytes(i['data_bytes'])} per rank, P_E={_bytes(i['expert_bytes'])} "
        f"({i['experts_per_rank']} expert(s) per rank), pre-expert {i['pre_expert_s']:.3g} s "
        f"at {plan['flops_per_s'] / 1e9:.3g} GFLOP/s ({how})",
        f"chosen   domains {ch['domain_sizes']}, p {_seq(ch['p'])}: predicted "
        f"{ch['predicted_s']:.3g} s, {ch['speedup_vs_classic']:.2f}x classic EP",
        "",
    ]
    header = ["", "domains", "p", "AG s", "A2A s", "predicted s", "vs classic"]
    rows = [
        [
            "*" if r["chosen"] else "",
            str(r["domain_sizes"]),
            _seq(r["p"]),
            _seq(r["ag_s"]),
            _seq(r["a2a_s"]),
            f"{r['predicted_s']:.3g}",
            f"{r['speedup_vs_classic']:.2f}x",
        ]
        for r in plan["candidates"]
    ]
    widths = [max(len(row[k]) for row in [header, *rows]) for k in range(len(header))]
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    lines += [
        "(AG s and A2A s per level, outermost first; A2A is one of the two all-to-alls; "
        "predicted = max(pre-expert, sum AG) + 2 sum A2A)",
        "",
        f"reason   {plan['reason']}",
        f"training {plan['training_step']['reason']} (a whole step: what "
        "`moesaic train --domains auto` uses)",
    ]
    return "\n".join(lines)


def _note(line: str) -> None:
    """One line on stderr (stdout stays the table, or the JSON with ``--json``)."""
    print(f"moesaic plan: {line}", file=sys.stderr)


def _profile(args: argparse.Namespace, spec: ClusterSpec) -> Any:
    """``--profile`` (checked against the cluster, ``--flops-per-s`` overriding its matmul
    rates), a profile of ``--flops-per-s`` alone, or this machine measured (torch)."""
    import dataclasses

    from moesaic.checks import check_positive
    from moesaic.sim.profile import Profile

    flops = args.flops_per_s
    if flops is not None:
        check_positive("flops_per_s (--flops-per-s)", flops)
    if args.profile:
        profile = load_option("profile", args.profile, Profile.load)
        check_profile(args, profile, spec, note=_note)
        profile = retimed(args, profile, note=_note)
        if flops is None:
            return profile
        return dataclasses.replace(profile, flops_per_s=flops, half_flops_per_s=0.0)
    retimed(args, None, note=_note)  # refuses --retime without a profile
    if flops is not None:
        return Profile(flops_per_s=flops, source="--flops-per-s")
    from moesaic.measure.machine import profile_here

    return profile_here("measured here by moesaic plan (matmul and op overhead)")


def _with_routing(args: argparse.Namespace, spec: ClusterSpec, profile: Any) -> Any:
    """``--measure-routing``: ``profile`` with the loads of the job's router on its data at
    the cluster's world batch (``train.routing_run``); unchanged, with a note, for a model file or
    when the measurement fails (the ranking then prices the routing prior, as without it)."""
    import dataclasses

    from moesaic.train.routing_run import measure_routing

    if getattr(args, "loads", None) is not None:
        raise ValueError("--measure-routing and --loads both give the expert loads: pass one")
    try:
        routing = measure_routing(args.model, world=spec.world_size)
    except (RuntimeError, ValueError, OSError) as exc:
        _note(f"--measure-routing failed ({str(exc).strip()[-300:]}): routing from the prior")
        return profile
    if routing is None:
        _note(f"--measure-routing: {args.model} is a model file (no data): routing from the prior")
        return profile
    return dataclasses.replace(profile, routing=routing)


def _ep_sizes(value: str | None, world: int, experts: int) -> list[int]:
    """``--ep``: None -> none below the world; "auto" -> every size below the world dividing
    it and ``experts``; else the comma list (checked by the planner)."""
    if value is None:
        return []
    if value.strip() == "auto":
        return [e for e in range(1, world) if world % e == 0 and experts % e == 0]
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        raise ValueError(
            f"ep (--ep) must be 'auto' or a comma list of integers, got {value!r}"
        ) from None


def build_ranking(args: argparse.Namespace) -> tuple[Any, float, dict[str, Any]]:
    """The ranking of ``args`` (:class:`moesaic.planning.planner.Plan`), its wall seconds and the
    job it was made for (``moesaic.train.plan.made_for``)."""
    from moesaic.checks import check_positive_int
    from moesaic.planning.planner import plan_runs
    from moesaic.train.plan import PLAN_SHAPE_FIELDS, made_for

    check_positive_int("top (--top)", args.top)
    for flag in ("tokens_per_rank", "dtype_bytes"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} applies to --domains-only only")
    spec = load_option("cluster", args.cluster, ClusterSpec.from_toml)
    profile = _profile(args, spec)
    if getattr(args, "measure_routing", False):
        profile = _with_routing(args, spec, profile)
    model = load_option("model", args.model, load_model_spec)
    ratios = _ratios(args.compression_ratio) or (1.0,)
    capacities = _capacities(getattr(args, "capacity_factor", None))
    model, prior = apply_loads(args, model, note=_note, profile=profile, world=spec.world_size)
    t0 = time.perf_counter()
    plan = plan_runs(
        spec,
        model,
        profile,
        compression_ratios=ratios,
        all_reduce=args.all_reduce,
        capacity_factors=capacities,
        routing_prior=prior,
        ep_sizes=_ep_sizes(getattr(args, "ep", None), spec.world_size, model.experts),
    )
    wall_s = time.perf_counter() - t0
    job = made_for(
        world_size=spec.world_size,
        cluster=spec.name,
        shape={name: getattr(model, name) for name in PLAN_SHAPE_FIELDS},
        profile=args.profile or f"{profile.source} ({profile.flops_per_s:.3g} FLOP/s)",
    )
    return plan, wall_s, job


def format_ranking(plan: Any, *, top: int, wall_s: float) -> str:
    """The table of the ``top`` fastest combinations, the pick, the reason, what cannot run."""
    header = ["#", "strategy", "schedule", "knobs", "predicted ms", "range ms", "bound ms"]
    header += ["compute ms", "comm ms"]
    rows = [
        [
            str(i + 1),
            c.strategy,
            c.schedule,
            c.knobs(),
            f"{c.predicted_ms:.4g}" + (" !" if c.caveat else "") + (" =" if c.tie else ""),
            "-" if c.range_ms is None else f"{c.range_ms[0]:.4g}-{c.range_ms[1]:.4g}",
            f"{c.bound_ms:.4g}",
            f"{c.compute_ms:.4g}",
            f"{c.comm_ms:.4g}",
        ]
        for i, c in enumerate(plan.ranked[:top])
    ]
    widths = [max(len(row[k]) for row in [header, *rows]) for k in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(0, "  ".join(cell.ljust(w) for cell, w in zip(header, widths)).rstrip())
    if len(plan.ranked) > top:
        lines.append(f"... {len(plan.ranked) - top} more (--top N, or --json for every one)")
    best = plan.chosen
    lines += [
        "(bound = max(compute, communication): the step with every transfer hidden; range: the "
        "simulator's 10th-90th percentile error band for the combination, and the routing "
        "prior's when it prices the prior; = : a tie with the fastest, in the tie rule's order)",
        "",
        f"pick     {best.name} {best.knobs()}",
        f"reason   {plan.reason}",
    ]
    caveats = dict.fromkeys(f"{c.name}: {c.caveat}" for c in plan.ranked if c.caveat)
    lines += [f"caveat   {text} (marked !)" for text in caveats]
    lines += [f"skipped  {name}: {why}" for name, why in plan.skipped]
    lines.append(
        f"priced   {len(plan.ranked)} combinations with {plan.simulations} simulations in "
        f"{wall_s:.2f} s (one representative rank each)"
    )
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    if args.domains_only:
        if getattr(args, "ep", None) is not None:
            raise ValueError("--ep applies to the ranking, not to --domains-only")
        plan = build_plan(args)
        print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
        return 0
    ranking, wall_s, job = build_ranking(args)
    model = load_model_spec(args.model)
    budget = getattr(args, "memory_per_rank", None)
    fit = apply_memory(model, budget, ranking, job["world_size"], _note)  # planning.plan_memory
    ranking = ranking if fit is None else fit.plan
    if args.json:
        for name, why in ranking.skipped:
            _note(f"skipped {name}: {why}")
        rows = ranking_json(ranking, job, () if fit is None else fit.peaks)
        for line in [] if fit is None else fit.dropped:
            _note(f"dropped {line}")
        print(json.dumps(rows, indent=1))
    else:
        print(format_ranking(ranking, top=args.top, wall_s=wall_s))
        if fit is not None:
            print("\n".join(memory_lines(fit, args.memory_per_rank)))
    return 0
