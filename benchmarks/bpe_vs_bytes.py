"""The default run on bytes against the same run on a BPE of the same corpus: validation bits per
byte against training time (issue 51 item 5).

Usage: ``OMP_NUM_THREADS=1 python benchmarks/bpe_vs_bytes.py [--steps 300] [--vocab-size 2048]
[--out benchmarks/results/bpe_vs_bytes_cpu.json]``.

The corpus of both is the default one (the standard library's ``.py`` files in the order
``moesaic train`` reads them, up to its 4 MB). The BPE is trained on those files and the shards
prepared by ``moesaic prepare`` (timed). Both runs are ``moesaic train`` with the default model
and options but ``--steps`` and ``--eval-every``; the token run's vocabulary is the tokenizer's.
Each validation is placed at the run's cumulative step time (the sum of its steps' times from
metrics.jsonl, validations and checkpoints excluded), so the two curves compare at equal
training time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moesaic.bench.meta import run_metadata
from moesaic.data.prepare import PrepareConfig, prepare
from moesaic.train.config import TrainConfig
from moesaic.train.data import _stdlib_files
from prepare_tokens import versions, write_json  # beside this script


def default_corpus_files(max_bytes: int) -> list[str]:
    """The files the default byte run reads its ``max_bytes`` from."""
    out, total = [], 0
    for f in _stdlib_files():
        if total >= max_bytes:
            break
        out.append(str(f))
        total += os.path.getsize(f)
    return out


def run(args: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "moesaic", "train", "--run-dir", str(run_dir), *args]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed, at_step = 0.0, {}
    for r in records:
        if r["kind"] == "train":
            tokens = TrainConfig().nproc * TrainConfig().batch_size * TrainConfig().model.seq_len
            elapsed += tokens / r["tokens_per_s"]
            at_step[r["step"]] = elapsed
    val = [
        {"step": r["step"], "train_s": at_step[r["step"]], "val_loss": r["val_loss"],
         "bits_per_byte": r["val_bits_per_byte"]}
        for r in records
        if r["kind"] == "val"
    ]  # fmt: skip
    return {"wall_s_end_to_end": wall, "train_s": elapsed, "validations": val}


def at_time(curve: list[dict], t: float) -> dict:
    """The last validation at or before training time ``t``."""
    return [v for v in curve if v["train_s"] <= t + 1e-9][-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--out", default="benchmarks/results/bpe_vs_bytes_cpu.json")
    args = parser.parse_args()
    max_bytes = TrainConfig().data_max_bytes
    files = default_corpus_files(max_bytes)
    common = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--no-progress"]
    with tempfile.TemporaryDirectory(prefix="moesaic-bpe-bench-") as tmp:
        t0 = time.perf_counter()
        cfg = PrepareConfig(inputs=files, out=f"{tmp}/tok", vocab_size=args.vocab_size)
        cfg.progress = False
        meta = prepare(cfg)
        prepare_s = time.perf_counter() - t0
        byte_run = run(common, Path(tmp) / "bytes")
        token_run = run([*common, "--data", f"{tmp}/tok"], Path(tmp) / "tokens")
    t = min(byte_run["train_s"], token_run["train_s"])
    result = {
        "meta": run_metadata(),
        "versions": versions(),
        "command": "python benchmarks/bpe_vs_bytes.py " + " ".join(sys.argv[1:]),
        "config": {**vars(args), "train_flags": common, "defaults": TrainConfig().to_dict()},
        "corpus": {
            "files": len(files),
            "bytes_on_disk": sum(os.path.getsize(f) for f in files),
            "tokens": meta["tokens"],
            "bytes_per_token": meta["bytes"] / meta["tokens"],
        },
        "bpe_prepare_s": prepare_s,
        "bytes": byte_run,
        "bpe": token_run,
        "at_equal_training_time": {
            "train_s": t,
            "bytes": at_time(byte_run["validations"], t),
            "bpe": at_time(token_run["validations"], t),
        },
        "note": (
            "2 CPU cores shared with other engineers' work; training time is the sum of step "
            "times (validations and checkpoints excluded). The byte run's corpus is the first "
            "4 MB of these files joined by blank lines; the BPE run's the whole files."
        ),
    }
    write_json(Path(args.out), result)
    print(json.dumps(result["at_equal_training_time"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
