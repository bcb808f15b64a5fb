"""``moesaic bench ...`` subcommands."""

from __future__ import annotations

import argparse


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def add_subparser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (results as JSON)")
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    layer = kinds.add_parser(
        "layer",
        help="fwd+bwd tokens/s and bytes of dropless vs padded dispatch, with transformers' "
        "Mixtral block as a peer",
    )
    layer.add_argument("--hidden", type=int, default=256, help="hidden size H (default 256)")
    layer.add_argument("--ffn", type=int, default=512, help="expert hidden size F (default 512)")
    layer.add_argument("--experts", type=int, default=8, help="experts E (default 8)")
    layer.add_argument("--topk", type=int, default=2, help="experts per token K (default 2)")
    layer.add_argument("--tokens", type=int, default=1024, help="tokens per rank (default 1024)")
    layer.add_argument(
        "--ep",
        type=_ints,
        default=None,
        help="EP sizes (default 1,2,4; with --quick 1,2; with --cluster its world size)",
    )
    layer.add_argument("--iters", type=int, default=8, help="timed steps (default 8)")
    layer.add_argument("--warmup", type=int, default=2, help="untimed steps (default 2)")
    layer.add_argument(
        "--no-transformers", action="store_true", help="skip the transformers Mixtral peer"
    )
    layer.add_argument(
        "--quick", action="store_true", help="a fast smoke run (256 tokens, 3 iters, EP 1,2)"
    )
    layer.add_argument(
        "--cluster",
        metavar="FILE",
        help="run the EP world inside this emulated cluster (TOML, see docs/cluster.md; needs "
        "root); --ep must then be its world size",
    )
    layer.add_argument(
        "--out",
        default="benchmarks/results/bench_layer_cpu.json",
        help="result JSON path (default benchmarks/results/bench_layer_cpu.json)",
    )
    layer.set_defaults(func=_run_layer)


def _run_layer(args: argparse.Namespace) -> int:
    from moesaic.bench.layer import LayerBench, format_table, run, write

    ep_sizes = args.ep
    if ep_sizes is None and args.cluster:
        from moesaic.cluster.spec import ClusterSpec

        ep_sizes = (ClusterSpec.from_toml(args.cluster).world_size,)
    elif ep_sizes is None:
        ep_sizes = (1, 2) if args.quick else (1, 2, 4)
    bench = LayerBench(
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_experts=args.experts,
        top_k=args.topk,
        tokens_per_rank=256 if args.quick else args.tokens,
        ep_sizes=ep_sizes,
        iters=3 if args.quick else args.iters,
        warmup=1 if args.quick else args.warmup,
        with_transformers=not args.no_transformers and _has_transformers(),
        cluster=args.cluster,
    )
    result = run(bench)
    print(format_table(result))
    print(f"wrote {write(result, args.out)}")
    return 0


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("transformers not installed: skipping the Mixtral peer (pip install '.[bench]')")
        return False
    return True
