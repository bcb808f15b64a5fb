"""The ``moesaic prepare`` subcommand (torch-free)."""

from __future__ import annotations

import argparse
import sys

EPILOG = """\
examples:
  moesaic prepare corpus/ --out data/tok --vocab-size 8192      # train a byte-level BPE
  moesaic prepare docs.jsonl --field text --tokenizer tokenizer.json --out data/tok
  moesaic prepare my_dataset/ --split train --tokenizer tokenizer.json --out data/tok
  moesaic train --data data/tok                                 # train on the shards
"""


def _prepare(args: argparse.Namespace) -> int:
    from moesaic.data.prepare import PrepareConfig, prepare

    cfg = PrepareConfig(
        inputs=args.inputs,
        out=args.out,
        format=args.format,
        field=args.field,
        split=args.split,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        train_bytes=args.train_bytes,
        eos=args.eos,
        shard_bytes=args.shard_bytes,
        **({} if args.workers is None else {"workers": args.workers}),
        skip_bad=args.skip_bad,
        progress=not args.no_progress,
    )
    meta = prepare(cfg)
    mb = meta["bytes"] / 1e6
    print(
        f"moesaic prepare: {args.out}: {meta['documents']} documents, {meta['bytes']} bytes -> "
        f"{meta['tokens']} {meta['dtype']} tokens in {len(meta['shards'])} shards "
        f"({meta['reused_shards']} reused) in {meta['seconds']:.1f} s "
        f"({mb / max(meta['seconds'], 1e-9):.1f} MB/s); vocabulary "
        f"{meta['tokenizer']['vocab_size']}, EOS {meta['tokenizer']['eos_token']!r}"
    )
    for reason, v in meta["skipped"].items():
        print(
            f"moesaic prepare: note: skipped {v['count']} ({reason}), first: {v['first']}",
            file=sys.stderr,
        )
    return 0


def add_subparser(subparsers) -> None:
    """Add ``prepare`` to the top-level ``moesaic`` parser."""
    from moesaic.data.sources import FORMATS

    p = subparsers.add_parser(
        "prepare",
        help="tokenize text, JSONL, parquet or a saved dataset into memory-mapped token shards",
        description=(
            "Tokenize the inputs (HF tokenizers: a given tokenizer.json, or a byte-level BPE "
            "trained on them) into flat token shards with a document index and a metadata file, "
            "in parallel; a rerun skips finished shards. `moesaic train --data OUT` trains on them."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files and directories, in order")
    p.add_argument("--out", required=True, metavar="DIR", help="the prepared directory")
    p.add_argument(
        "--format",
        default="auto",
        choices=FORMATS,
        help="input format (default auto: .jsonl, .parquet, a saved dataset, else text)",
    )
    p.add_argument(
        "--field",
        default="text",
        help="text field of JSONL lines, parquet and dataset rows (default: text)",
    )
    p.add_argument("--split", default=None, help="split of a saved DatasetDict")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", metavar="FILE.json", help="a tokenizers tokenizer.json")
    tok.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="train a byte-level BPE of N tokens on the inputs",
    )
    p.add_argument(
        "--train-bytes",
        type=int,
        default=50_000_000,
        help="train the BPE on the first this many bytes (default: 50000000)",
    )
    p.add_argument(
        "--eos",
        default=None,
        metavar="TOKEN",
        help="end-of-document token of --tokenizer (default: <|endoftext|>, </s>, ...)",
    )
    p.add_argument(
        "--shard-bytes",
        type=int,
        default=32 * 2**20,
        help="input bytes per shard, one worker's task (default: 32 MiB)",
    )
    p.add_argument(
        "--workers", type=int, default=None, help="worker processes (default: the CPU cores)"
    )
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip bad documents (empty, not UTF-8, no field), counted by reason",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_prepare)
