"""``moesaic bench ...`` subcommands.

Torch-free until a benchmark runs. Everything that can be refused is refused before the run
starts, in one line: a bad option value (by argparse, exit 2), a run that would replace the
committed result (:func:`moesaic.bench.options.resolve_out`), a world this machine cannot hold
(:func:`moesaic.bench.options.check_world_sizes`).
"""

from __future__ import annotations

import argparse

from moesaic.bench.interrupt import interrupts_to_main_thread
from moesaic.bench.options import (
    DEFAULT_OUT,
    MAX_PROCESSES_PER_CORE,
    check_world_sizes,
    resolve_out,
    write_json,
)

# What --quick sets, where the option is not given explicitly.
QUICK = {"tokens": 256, "iters": 3, "warmup": 1, "ep": (1, 2)}
# The defaults otherwise (those of LayerBench).
FULL = {"tokens": 1024, "iters": 8, "warmup": 2, "ep": (1, 2, 4)}

# LayerBench field -> the option that sets it, to say how a run differs from the default.
_OPTIONS = {
    "hidden_size": "--hidden",
    "ffn_hidden_size": "--ffn",
    "num_experts": "--experts",
    "top_k": "--topk",
    "num_shared_experts": "--shared-experts",
    "shared_expert_hidden_size": "--shared-expert-hidden",
    "tokens_per_rank": "--tokens",
    "ep_sizes": "--ep",
    "iters": "--iters",
    "warmup": "--warmup",
    "cluster": "--cluster",
    "strategies": "--strategies",
    "peers": "--peers",
    "capacity_factor": "--capacity-factor",
}


def _int(text: str, minimum: int) -> int:
    rule = "> 0" if minimum == 1 else f">= {minimum}"
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an int {rule}, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    return _int(text, 1)


def _non_negative_int(text: str) -> int:
    return _int(text, 0)


def _ep_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        sizes = (0,)
    if min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"EP sizes must be ints > 0, got {text!r}")
    return sizes


def _names(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"must name at least one, got {text!r}")
    return names


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def add_subparser(sub: argparse._SubParsersAction) -> None:
    """Adds ``bench`` and its benchmarks to the top-level ``moesaic`` parser."""
    bench = sub.add_parser("bench", help="benchmarks (results as JSON)")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    layer = kinds.add_parser(
        "layer",
        help="fwd+bwd tokens/s and bytes of the MoE strategies, with transformers' "
        "Mixtral block as a peer",
        description="Forward+backward throughput and bytes of the dispatch strategies. Only the "
        f"default run writes {DEFAULT_OUT} (the committed result); any other run needs --out.",
    )
    pos = _positive_int
    layer.add_argument("--hidden", type=pos, default=256, help="hidden size H (default 256)")
    layer.add_argument("--ffn", type=pos, default=512, help="expert hidden size F (default 512)")
    layer.add_argument("--experts", type=pos, default=8, help="experts E (default 8)")
    layer.add_argument("--topk", type=pos, default=2, help="experts per token K (default 2)")
    layer.add_argument(
        "--shared-experts",
        type=_non_negative_int,
        default=0,
        help="shared experts every token passes through (default 0; the torchtitan peer gets "
        "them too, the transformers Mixtral block is then skipped and deepspeed refused)",
    )
    layer.add_argument(
        "--shared-expert-hidden",
        type=pos,
        default=None,
        help="hidden size of each shared expert (default: --ffn)",
    )
    layer.add_argument("--tokens", type=pos, help="tokens per rank (default 1024; --quick 256)")
    layer.add_argument(
        "--ep",
        type=_ep_sizes,
        default=None,
        help="EP sizes (default 1,2,4; with --quick 1,2; with --cluster its world size)",
    )
    layer.add_argument("--iters", type=pos, help="timed steps (default 8; --quick 3)")
    layer.add_argument(
        "--warmup", type=_non_negative_int, help="untimed steps (default 2; --quick 1)"
    )
    layer.add_argument(
        "--no-transformers", action="store_true", help="skip the transformers Mixtral peer"
    )
    layer.add_argument(
        "--strategies",
        type=_names,
        default=None,
        help="moesaic strategies to time, comma-separated (default: every registered strategy "
        "that runs without a cluster description)",
    )
    layer.add_argument(
        "--peers",
        type=_names,
        default=(),
        help="other libraries' MoE layers to time beside ours (torchtitan, deepspeed; only when "
        "installed, see docs/performance.md): same weights, outputs checked before timing",
    )
    layer.add_argument(
        "--capacity-factor",
        type=_positive_float,
        default=1.25,
        help="capacity factor of the padded layer compared with deepspeed (default 1.25)",
    )
    layer.add_argument(
        "--malloc-default",
        action="store_true",
        help="leave glibc's malloc as it is (default: keep freed memory in the processes, "
        "see moesaic.bench.allocator)",
    )
    layer.add_argument(
        "--quick",
        action="store_true",
        help="a fast smoke run: 256 tokens, 3 iters, 1 warmup, EP 1,2 unless given explicitly",
    )
    layer.add_argument(
        "--cluster",
        metavar="FILE",
        help="run the EP world inside this emulated cluster (TOML, see docs/cluster.md; needs "
        "root); --ep must then be its world size",
    )
    layer.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help=f"run EP worlds of more than {MAX_PROCESSES_PER_CORE} processes per core",
    )
    layer.add_argument(
        "--out",
        metavar="PATH",
        help=f"result JSON file, or a directory to write it into; required unless every size "
        f"option has its default (that run writes {DEFAULT_OUT})",
    )
    layer.set_defaults(func=_run_layer)


def _resolved(args: argparse.Namespace, name: str):
    """An option's value: explicit if given, else --quick's, else the full run's default."""
    value = getattr(args, name)
    if value is not None:
        return value
    return (QUICK if args.quick else FULL)[name]


def _run_layer(args: argparse.Namespace) -> int:
    ep_sizes = args.ep
    cluster_world = None
    if args.cluster:
        from moesaic.cluster.spec import ClusterSpec

        cluster_world = ClusterSpec.from_toml(args.cluster).world_size
        ep_sizes = ep_sizes or (cluster_world,)
    ep_sizes = ep_sizes or _resolved(args, "ep")
    # Before torch: a world this machine cannot hold is refused at once.
    check_world_sizes(
        ep_sizes,
        allow_oversubscribe=args.allow_oversubscribe,
        option=f"--cluster {args.cluster}" if cluster_world in ep_sizes else None,
    )
    # Before torch: an unknown strategy or a peer that is not installed is refused at once.
    from moesaic.bench.peer_names import check_names

    check_names(args.strategies or (), args.peers)
    # Ctrl-C: one KeyboardInterrupt, no worker tracebacks; entered before torch is imported
    # (moesaic.bench.interrupt says why).
    with interrupts_to_main_thread():
        return _measure_layer(args, ep_sizes)


def _measure_layer(args: argparse.Namespace, ep_sizes: tuple[int, ...]) -> int:
    from moesaic.bench.layer import LayerBench, format_table, run

    bench = LayerBench(
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_experts=args.experts,
        top_k=args.topk,
        num_shared_experts=args.shared_experts,
        shared_expert_hidden_size=args.shared_expert_hidden,
        tokens_per_rank=_resolved(args, "tokens"),
        ep_sizes=ep_sizes,
        iters=_resolved(args, "iters"),
        warmup=_resolved(args, "warmup"),
        with_transformers=not args.no_transformers
        and _mixtral_fits(args.shared_experts)
        and _has_transformers(),
        cluster=args.cluster,
        **({"strategies": args.strategies} if args.strategies else {}),
        peers=args.peers,
        capacity_factor=args.capacity_factor,
        retain_freed_memory=not args.malloc_default,
    )
    differences = _differences(bench, LayerBench(), quick=args.quick)
    out = resolve_out(
        args.out, default_run=not differences, differences=differences, cluster=args.cluster
    )
    sizes = ",".join(map(str, bench.ep_sizes))
    shared = ""
    if bench.num_shared_experts:
        width = bench.shared_expert_hidden_size or bench.ffn_hidden_size
        shared = f"{bench.num_shared_experts} shared expert(s) of {width}, "
    print(
        f"bench layer: EP {sizes}, T={bench.tokens_per_rank} per rank, H={bench.hidden_size}, "
        f"F={bench.ffn_hidden_size}, E={bench.num_experts}, K={bench.top_k}, "
        f"{shared}{bench.iters} iters; result -> {out}",
        flush=True,
    )
    result = run(bench)
    print(format_table(result))
    print(f"wrote {write_json(result, out)}")
    return 0


def _differences(bench, default, *, quick: bool) -> str:
    """How ``bench`` differs from the default run, as options (e.g. ``--quick, --tokens 256``)."""
    out = ["--quick"] if quick else []
    for field, option in _OPTIONS.items():
        value = getattr(bench, field)
        if value != getattr(default, field):
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
            out.append(f"{option} {shown}")
    if bench.with_transformers != default.with_transformers:
        out.append("--no-transformers")
    if bench.retain_freed_memory != default.retain_freed_memory:
        out.append("--malloc-default")
    return ", ".join(out)


def _mixtral_fits(shared_experts: int) -> bool:
    if shared_experts:
        print("shared experts: skipping the transformers Mixtral peer (it has none)")
        return False
    return True


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers not installed: skipping the Mixtral peer (pip install '.[bench]')")
        return False
    return True
