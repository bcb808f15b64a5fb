"""``moesaic plan``: HybridEP's domain sizes for a model on a cluster, with every candidate priced.

Reads the cluster TOML of ``moesaic cluster`` (``--cluster``) and, for ``--model``, the
training TOML of ``moesaic train --config`` or the simulator's model file (``moesaic simulate
--model``, :func:`moesaic.sim.model.load_model`: a model file plans as the training config of its
model and batch with the default run options, ``--dtype-bytes`` defaulting to its
``act_bytes``), derives the cost model's inputs the way
``moesaic train --domains auto`` does (``moesaic.train.domains``: tokens per MoE forward, the
steady-state MoE block, fp32), and prints ``plan_domains``'s result: the chosen domain sizes and
``p`` per level, a table of every candidate and the one-line reason; ``--json`` prints the same
as one JSON object.

The cluster's ranks are the expert-parallel group (the TOML's ``nproc`` and ``ep`` are not
used). Torch-free, except when no ``--flops-per-s`` is given: the GEMM throughput is then
measured with torch on this machine (``measure_gemm_flops``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from moesaic.cluster.spec import ClusterSpec
from moesaic.planning.costmodel import DomainCandidate, DomainPlan, StreamInputs, plan_domains
from moesaic.sim.cli_files import load_option

PLAN_EPILOG = """\
examples:
  moesaic plan --cluster examples/clusters/2dc_2node_small.toml --model examples/train_tiny.toml
  moesaic plan --cluster examples/clusters/hybridep_2dc.toml \\
      --model examples/models/hybridep_small.toml --flops-per-s 1e12
  moesaic plan --cluster examples/clusters/2dc_2node.toml --model examples/train_tiny.toml \\
      --flops-per-s 1e12 --tokens-per-rank 8192 --compression-ratio 50 --json
"""


def add_subparser(subparsers) -> None:
    """Add ``plan`` to the top-level ``moesaic`` parser."""
    p = subparsers.add_parser(
        "plan",
        help="HybridEP expert-domain sizes for a model on a cluster (cost model)",
        description=(
            "Price every choice of HybridEP expert-domain sizes (one per cluster level) with the "
            "stream-based cost model and print the fastest, a table of all of them and why."
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--flops-per-s",
        type=float,
        metavar="X",
        help="a rank's GEMM throughput, FLOP/s (default: measured here with torch)",
    )
    p.add_argument(
        "--tokens-per-rank",
        type=int,
        metavar="T",
        help="tokens per rank per MoE forward (default: batch_size x seq_len / pipeline_degree)",
    )
    p.add_argument(
        "--compression-ratio",
        type=float,
        metavar="CR",
        help="SR compression ratio of gathered experts (default: the model's "
        "expert_compression_ratio)",
    )
    p.add_argument(
        "--dtype-bytes",
        type=int,
        metavar="N",
        help="bytes per token element and weight (default: 4, moesaic train's fp32; a model "
        "file's act_bytes)",
    )
    p.set_defaults(func=run_plan)


def _train_config(path: str) -> tuple[Any, int]:
    """``--model``'s training config (a model file's converted) and its default bytes per
    element."""
    from moesaic.sim.model import ModelSpec, load_model, train_config_of

    model = load_model(path)
    if not isinstance(model, ModelSpec):
        return model, 4
    try:
        return train_config_of(model), model.act_bytes
    except ValueError as exc:
        raise ValueError(f"model file {path!r}: {exc}") from None


def build_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The plan of ``args`` as plain data (what ``--json`` prints)."""
    from moesaic.checks import check_positive, check_positive_int
    from moesaic.train.domains import (
        dense_blocks_before,
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
        from moesaic.planning.costmodel import measure_gemm_flops

        flops = measure_gemm_flops()
    else:
        flops = check_positive("flops_per_s (--flops-per-s)", args.flops_per_s)
    cr = model.moe.expert_compression_ratio
    if args.compression_ratio is not None:
        cr = args.compression_ratio
        if not cr >= 1:
            raise ValueError(f"compression_ratio (--compression-ratio {cr}) must be >= 1")
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
    """The human-readable report of :func:`build_plan`'s result."""
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


def run_plan(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0
