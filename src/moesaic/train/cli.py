"""The ``moesaic train``, ``moesaic generate`` and ``moesaic export`` subcommands."""

from __future__ import annotations

import argparse

TRAIN_EPILOG = """\
examples:
  moesaic train                                 # default MoE GPT on the stdlib source, 2 ranks
  moesaic train --nproc 4 --ep 2                # 2 EP groups of 2 ranks, data parallel across
  moesaic train --config examples/train_tiny.toml --steps 50
  moesaic train --resume --ep 1                 # continue, resharding the experts
  moesaic train --config examples/train_tiny.toml --schedule flowmoe --pipeline-degree 2 \\
      --trace trace.json --trace-png trace.png  # FlowMoE pipeline, timeline of the last steps
  moesaic train --max-restarts 2                # survive a killed worker
  moesaic train --emulate examples/clusters/flowmoe_2rank.toml  # on an emulated network (root)
multi-node (each node):
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
      -m moesaic.train --ep 8 --run-dir /shared/run
"""


# The shell's exit status for a process ended by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130


def _train(args: argparse.Namespace) -> int:
    import sys

    from moesaic.train.flags import config_from_args
    from moesaic.train.launch import launch

    try:
        launch(config_from_args(args))
    except KeyboardInterrupt:
        print("moesaic train: interrupted; the workers were stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _generate(args: argparse.Namespace) -> int:
    from moesaic.train.generate import generate_text

    text = generate_text(
        args.checkpoint,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(text)
    return 0


def _export(args: argparse.Namespace) -> int:
    from moesaic.train.export import export_hf

    out = export_hf(args.checkpoint, args.hf)
    print(
        f"moesaic export: {args.checkpoint} -> {out} (transformers: config, safetensors, tokenizer)"
    )
    return 0


def add_subparser(subparsers) -> None:
    """Add ``train`` and ``generate`` to the top-level ``moesaic`` parser."""
    from moesaic.train.config import TrainConfig
    from moesaic.train.flags import add_train_arguments

    train = subparsers.add_parser(
        "train",
        help="expert-parallel training of an MoE GPT (elastic, checkpointed)",
        description=(
            "Train a byte-level MoE GPT with expert parallelism (and data parallelism across "
            "EP groups) under torch's elastic launcher. Options come from defaults, then "
            "--config FILE (TOML), then flags. Writes checkpoints and metrics.jsonl to --run-dir."
        ),
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(train)
    train.set_defaults(func=_train)

    gen = subparsers.add_parser(
        "generate",
        help="sample text from a trained checkpoint",
        description="Sample bytes from a checkpoint (any EP size) in one process.",
    )
    run_dir = TrainConfig.__dataclass_fields__["run_dir"].default
    gen.add_argument(
        "--checkpoint",
        default=run_dir,
        metavar="DIR",
        help=f"a checkpoint or a run directory (default: {run_dir}, the default run's)",
    )
    gen.add_argument("--prompt", default="", help="text to continue (default: empty)")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="bytes to sample")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.set_defaults(func=_generate)

    export = subparsers.add_parser(
        "export",
        help="write a checkpoint as a transformers model directory (with its tokenizer)",
        description=(
            "Write a --hf-config run's checkpoint as a transformers directory: config.json, "
            "model.safetensors and the tokenizer, which AutoModelForCausalLM and AutoTokenizer "
            "load to generate what `moesaic generate` does. An MoEGPT is not exportable."
        ),
    )
    export.add_argument(
        "--checkpoint",
        default=run_dir,
        metavar="DIR",
        help=f"a checkpoint or a run directory (default: {run_dir})",
    )
    export.add_argument("--hf", required=True, metavar="OUT", help="the directory to write (new)")
    export.set_defaults(func=_export)
