"""``moesaic prepare`` on >= 200 MB of Python source, beside a plain ``tokenizers`` encode_batch of
the same files, and the resident memory of a training rank at two corpus sizes (issue 51).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/prepare_tokens.py [--target-mb 200] [--out
benchmarks/results/prepare_tokens_cpu.json]``.

The corpus: every ``.py`` file of this Python's standard library, then of the virtualenv's
site-packages, sorted, until ``--target-mb``. Phases, in one run:

1. train a byte-level BPE (``--vocab-size``) on the first ``--train-mb`` of it (timed apart);
2. ``--repeats`` times, alternating (the machine is shared: side by side, medians): a plain
   ``tokenizers`` ``encode_batch`` of every file (read, strict UTF-8, batches of 256, the
   library's own thread pool on every core), and ``prepare`` of the same files with that
   tokenizer into a fresh directory (``--workers`` processes; shards written, hashed, indexed);
3. prepare a ``--small-mb`` prefix too, then train one rank in a fresh process on each corpus
   (``--steps`` steps of the default model, vocabulary the tokenizer's) and read its resident
   memory from ``/proc/self/status`` (VmHWM peak, RssAnon private, RssFile mapped file pages).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from moesaic.bench.meta import run_metadata
from moesaic.data.prepare import ENCODE_BATCH, PrepareConfig, prepare
from moesaic.data.tokenizer import train_bpe


def corpus_files(target_bytes: int) -> list[str]:
    """The stdlib's .py files, then site-packages', sorted, up to ``target_bytes``."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"])]
    out, total = [], 0
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            skip = ("__pycache__",) if root == roots[1] else ("site-packages", "__pycache__")
            dirnames[:] = sorted(d for d in dirnames if d not in skip)
            for f in sorted(filenames):
                if f.endswith(".py"):
                    p = os.path.join(dirpath, f)
                    out.append(p)
                    total += os.path.getsize(p)
                    if total >= target_bytes:
                        return out
    return out


def _texts(files: list[str]):
    for f in files:
        data = Path(f).read_bytes()
        if not data.strip():
            continue
        try:
            yield data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def plain_encode(files: list[str], tokenizer_json: str) -> tuple[float, int, int]:
    """(seconds, bytes, tokens) of reading and encode_batch-ing every file."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    t0 = time.perf_counter()
    nbytes = ntok = 0
    batch: list[str] = []
    for text in _texts(files):
        batch.append(text)
        nbytes += len(text.encode())
        if len(batch) == ENCODE_BATCH:
            ntok += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
            batch = []
    if batch:
        ntok += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
    return time.perf_counter() - t0, nbytes, ntok


def run_prepare(files: list[str], tok_path: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cfg = PrepareConfig(inputs=files, out=str(out), tokenizer=str(tok_path), workers=workers)
    cfg.skip_bad, cfg.progress = True, False
    return prepare(cfg)


def rss_of_training(data: Path, steps: int, run_dir: Path) -> dict:
    """A fresh process trains one rank on ``data``; its memory figures."""
    code = (
        "import json,sys\n"
        "from moesaic.train.config import TrainConfig\n"
        "from moesaic.train.loop import train\n"
        f"cfg = TrainConfig.from_dict({{'data': {str(data)!r}, 'run_dir': {str(run_dir)!r}, "
        f"'nproc': 1, 'steps': {steps}, 'eval_every': 0, 'ckpt_every': 0, 'save_final': False, "
        "'progress': False, 'threads': 1})\n"
        "s = train(cfg)\n"
        "st = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
        "kb = lambda k: int(st[k].split()[0])\n"
        "print(json.dumps({k: kb(k) for k in ('VmHWM', 'VmRSS', 'RssAnon', 'RssFile')} "
        "| {'tokens_per_s': s.get('tokens_per_s_median'), 'vocab': cfg.model.vocab_size}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=900
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_json(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def versions() -> dict[str, str]:
    """The data stack's versions (run_metadata gives Python's and torch's)."""
    import numpy
    import tokenizers
    import transformers

    return {
        "tokenizers": tokenizers.__version__,
        "numpy": numpy.__version__,
        "transformers": transformers.__version__,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-mb", type=float, default=200)
    parser.add_argument("--small-mb", type=float, default=50)
    parser.add_argument("--train-mb", type=float, default=20)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="benchmarks/results/prepare_tokens_cpu.json")
    parser.add_argument(
        "--rss-only",
        metavar="WORKDIR",
        help="only phase 3, --repeats times alternating, in WORKDIR (kept: prepare reuses its "
        "shards and tokenizer on a rerun); results to --out",
    )
    args = parser.parse_args()
    if args.rss_only:
        return rss_only(args)
    files = corpus_files(int(args.target_mb * 1e6))
    small = corpus_files(int(args.small_mb * 1e6))
    tmp = Path(tempfile.mkdtemp(prefix="moesaic-prepare-bench-"))
    try:
        t0 = time.perf_counter()
        tok_json = train_bpe(_texts_upto(files, int(args.train_mb * 1e6)), args.vocab_size)
        train_s = time.perf_counter() - t0
        tok_path = tmp / "tokenizer.json"
        tok_path.write_text(tok_json)
        plain, prep = [], []
        for _ in range(args.repeats):
            plain.append(plain_encode(files, tok_json))
            t0 = time.perf_counter()
            meta = run_prepare(files, tok_path, tmp / "full", args.workers)
            prep.append((time.perf_counter() - t0, meta))
        small_meta = run_prepare(small, tok_path, tmp / "small", args.workers)
        rss = {
            "small": rss_of_training(tmp / "small", args.steps, tmp / "run_small"),
            "full": rss_of_training(tmp / "full", args.steps, tmp / "run_full"),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta = prep[-1][1]
    mb = meta["bytes"] / 1e6
    plain_s = [p[0] for p in plain]
    prep_s = [p[0] for p in prep]
    result = {
        "meta": run_metadata(),
        "versions": versions(),
        "command": "python benchmarks/prepare_tokens.py " + " ".join(sys.argv[1:]),
        "config": vars(args),
        "corpus": {
            "files": len(files),
            "bytes_on_disk": sum(os.path.getsize(f) for f in files),
            "documents": meta["documents"],
            "utf8_bytes_tokenized": meta["bytes"],
            "tokens": meta["tokens"],
            "shards": len(meta["shards"]),
            "dtype": meta["dtype"],
            "skipped": meta["skipped"],
            "bytes_per_token": meta["bytes"] / meta["tokens"],
        },
        "bpe_training": {"seconds": train_s, "train_mb": args.train_mb},
        "plain_encode_batch": {
            "seconds": plain_s,
            "median_MB_per_s": mb / statistics.median(plain_s),
            "tokens": plain[-1][2],
        },
        "prepare": {
            "seconds": prep_s,
            "median_MB_per_s": mb / statistics.median(prep_s),
            "workers": args.workers,
        },
        "prepare_over_plain_time": statistics.median(prep_s) / statistics.median(plain_s),
        "training_rank_memory_kB": {
            "small_corpus_tokens": small_meta["tokens"],
            "full_corpus_tokens": meta["tokens"],
            **rss,
        },
        "note": (
            "2 CPU cores shared with other engineers' work (load average 3-6): medians of "
            "alternating runs. The plain encode counts UTF-8 bytes of the same documents "
            "(empty and non-UTF-8 files skipped by both). Memory: one rank (world 1, in a fresh "
            "process), the default model with the tokenizer's vocabulary; RssFile is mapped "
            "shard pages (page cache, reclaimable), RssAnon the process' own memory."
        ),
    }
    write_json(Path(args.out), result)
    print(json.dumps({k: result[k] for k in ("prepare", "plain_encode_batch")}, indent=1))
    print(json.dumps(result["training_rank_memory_kB"], indent=1))
    return 0


def rss_only(args: argparse.Namespace) -> int:
    work = Path(args.rss_only)
    work.mkdir(parents=True, exist_ok=True)
    files = corpus_files(int(args.target_mb * 1e6))
    small = corpus_files(int(args.small_mb * 1e6))
    tok_path = work / "tokenizer.json"
    if not tok_path.is_file():
        tok_path.write_text(
            train_bpe(_texts_upto(files, int(args.train_mb * 1e6)), args.vocab_size)
        )
    corpora = {}
    for name, group in (("small", small), ("full", files)):
        cfg = PrepareConfig(inputs=group, out=str(work / name), tokenizer=str(tok_path))
        cfg.workers, cfg.skip_bad, cfg.progress = args.workers, True, False
        corpora[name] = prepare(cfg)  # a rerun reuses every shard
    runs: dict[str, list[dict]] = {"small": [], "full": []}
    for _ in range(args.repeats):
        for name in ("small", "full"):
            shutil.rmtree(work / f"run_{name}", ignore_errors=True)
            runs[name].append(rss_of_training(work / name, args.steps, work / f"run_{name}"))
    result = {
        "meta": run_metadata(),
        "versions": versions(),
        "command": "python benchmarks/prepare_tokens.py " + " ".join(sys.argv[1:]),
        "config": vars(args),
        "corpus_tokens": {k: v["tokens"] for k, v in corpora.items()},
        "corpus_utf8_bytes": {k: v["bytes"] for k, v in corpora.items()},
        "training_rank_memory_kB": runs,
        "note": (
            "One rank (world 1) in a fresh process per run, the default model with the "
            "tokenizer's vocabulary, --steps steps, runs alternating small/full; VmHWM is the "
            "process' peak resident size, RssAnon its own memory at the end, RssFile mapped "
            "file pages at the end (libraries and shard pages: page cache, reclaimable). 2 CPU "
            "cores shared with other work."
        ),
    }
    write_json(Path(args.out), result)
    print(json.dumps(runs, indent=1))
    return 0


def _texts_upto(files: list[str], budget: int):
    for text in _texts(files):
        yield text
        budget -= len(text)
        if budget <= 0:
            return


if __name__ == "__main__":
    sys.exit(main())
