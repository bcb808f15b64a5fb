"""``moesaic prepare``: inputs -> tokenizer -> token shards, parallel, idempotent and atomic.

The inputs (:mod:`moesaic.data.sources`) are cut into shards of about ``shard_bytes`` of input,
in order; each shard is tokenized by one worker process (``tokenizers``' ``encode_batch``, EOS
after every document) and written as described in :mod:`moesaic.data.shards`. A shard's record
holds the key of what made it (its inputs' paths, sizes and mtimes, the tokenizer's sha256, the
options), so a rerun skips every shard whose record and files are in place and rebuilds the
others. The metadata is deleted first and written last: until a run finishes, the directory
does not read as a prepared corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moesaic.data.shards import (
    FORMAT,
    META_NAME,
    TOKENIZER_NAME,
    dtype_for,
    itemsize,
    shard_name,
    write_atomic,
    write_json_atomic,
)
from moesaic.data.sources import FORMATS, Source, documents, find_sources
from moesaic.data.tokenizer import (
    TokenizerInfo,
    describe_tokenizer,
    load_tokenizer_text,
    train_bpe,
)

# Documents handed to encode_batch at once: enough to amortise the call, few enough that a
# batch of large files stays small in memory.
ENCODE_BATCH = 256
TRAIN_RECORD = "tokenizer.train.json"


class PrepareError(RuntimeError):
    """A write of ``prepare`` failed (a full disk); the message names the file."""


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    """One ``moesaic prepare`` run.

    Attributes:
        inputs: files and directories (text, ``.jsonl``, ``.parquet``) or a dataset saved with
            ``save_to_disk``; their documents in this order.
        out: the prepared directory (created).
        format: ``auto`` (by suffix), or one of ``text``, ``jsonl``, ``parquet``, ``dataset``.
        field: the text field of JSONL lines, parquet and dataset rows.
        split: the split of a saved ``DatasetDict``.
        tokenizer: a ``tokenizer.json``; None: train a byte-level BPE of ``vocab_size``.
        vocab_size: the trained BPE's vocabulary (EOS and the 256 bytes included).
        train_bytes: train the BPE on the first this many bytes of documents.
        eos: the end-of-document token of ``tokenizer`` (default: the first of
            ``tokenizer.EOS_CANDIDATES`` it has).
        shard_bytes: input bytes per shard (a shard is one worker's task).
        workers: worker processes (1: in this process).
        skip_bad: skip bad documents (counted by reason in the metadata) instead of stopping
            at the first.
        progress: a tqdm bar on stderr.
    """

    inputs: list[str]
    out: str
    format: str = "auto"
    field: str = "text"
    split: str | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    train_bytes: int = 50_000_000
    eos: str | None = None
    shard_bytes: int = 32 * 2**20
    workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    skip_bad: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("inputs must name at least one file or directory")
        if (self.tokenizer is None) == (self.vocab_size is None):
            raise ValueError(
                "give exactly one of tokenizer (--tokenizer FILE.json) and vocab_size "
                "(--vocab-size N: train a byte-level BPE on the corpus)"
            )
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        for name in ("shard_bytes", "workers", "train_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
        if self.eos is not None and self.tokenizer is None:
            raise ValueError(
                "eos (--eos) names a token of a given --tokenizer; a trained BPE's "
                "EOS is <|endoftext|>"
            )


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _plan(sources: list[Source], shard_bytes: int) -> list[list[Source]]:
    """Consecutive sources grouped into shards of about ``shard_bytes`` each."""
    shards: list[list[Source]] = [[]]
    size = 0
    for src in sources:
        if shards[-1] and size + src.size > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(src)
        size += src.size
    return shards


def _training_texts(
    sources: list[Source], cfg: PrepareConfig, skipped: dict | None
) -> Iterator[str]:
    budget = cfg.train_bytes
    for src in sources:
        for doc in documents(src, cfg.field, skipped):
            yield doc
            budget -= len(doc)
            if budget <= 0:
                return


def _tokenizer_text(sources: list[Source], cfg: PrepareConfig, root: Path) -> str:
    """The run's tokenizer.json text: the given file's, or a BPE trained here (reused from a
    previous run of the same inputs and options)."""
    if cfg.tokenizer is not None:
        return load_tokenizer_text(cfg.tokenizer)[1]
    key = _key([cfg.vocab_size, cfg.train_bytes, cfg.field, [s.key() for s in sources]])
    record, path = root / TRAIN_RECORD, root / TOKENIZER_NAME
    if record.is_file() and path.is_file():
        try:
            if json.loads(record.read_text()).get("key") == key:
                return path.read_text(encoding="utf-8")
        except (OSError, ValueError):
            pass  # an unreadable record: train again
    skipped: dict[str, list] | None = {} if cfg.skip_bad else None
    assert cfg.vocab_size is not None  # PrepareConfig: one of the two
    return train_bpe(_training_texts(sources, cfg, skipped), cfg.vocab_size)


# ---- one shard, in a worker process -------------------------------------------------------

_WORKER: dict[str, Any] = {}  # the worker process's tokenizer (set once by _init_worker)


def _init_worker(tokenizer_text: str, serial: bool = False) -> None:
    if serial:  # one worker process per core: its encode_batch stays on one thread
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    _WORKER["tok"] = Tokenizer.from_str(tokenizer_text)


@dataclass(frozen=True, slots=True)
class ShardJob:
    root: str
    name: str
    sources: tuple[Source, ...]
    key: str
    field: str
    skip_bad: bool
    eos_id: int
    dtype: str


def build_shard(job: ShardJob) -> dict[str, Any]:
    """Tokenize ``job``'s documents into its three files; returns the shard's record."""
    tok = _WORKER["tok"]
    root = Path(job.root)
    skipped: dict[str, list] | None = {} if job.skip_bad else None
    ends: list[int] = []
    nbytes: list[int] = []
    digest = hashlib.sha256()
    bin_path = root / f"{job.name}.bin"

    def docs() -> Iterator[str]:
        for src in job.sources:
            yield from documents(src, job.field, skipped)

    def write_tokens(fh) -> None:
        total, batch = 0, []
        for doc in docs():
            batch.append(doc)
            if len(batch) == ENCODE_BATCH:
                total = _write_batch(fh, tok, batch, job, total, ends, nbytes, digest)
                batch = []
        if batch:
            _write_batch(fh, tok, batch, job, total, ends, nbytes, digest)

    idx_path = root / f"{job.name}.idx.npy"
    try:
        write_atomic(bin_path, write_tokens)
        idx = np.array([ends, nbytes], dtype=np.int64).T.reshape(-1, 2)
        write_atomic(idx_path, lambda fh: np.save(fh, idx))
        record = {
            "name": job.name,
            "key": job.key,
            "tokens": ends[-1] if ends else 0,
            "documents": len(ends),
            "bytes": sum(nbytes),
            "sha256": digest.hexdigest(),
            "skipped": skipped or {},
        }
        write_json_atomic(root / f"{job.name}.json", record)
    except OSError as exc:
        raise PrepareError(
            f"writing shard {job.name} in {root} failed: {exc.strerror or exc} (nothing of it "
            "is left; the metadata is written only when every shard is done)"
        ) from None
    return record


def _write_batch(fh, tok, batch, job: ShardJob, total, ends, nbytes, digest) -> int:
    encoded = tok.encode_batch(batch, add_special_tokens=False)
    flat: list[int] = []
    for doc, enc in zip(batch, encoded):
        flat.extend(enc.ids)
        flat.append(job.eos_id)
        ends.append(total + len(flat))
        nbytes.append(len(doc.encode("utf-8")))
    data = np.array(flat, dtype=job.dtype).tobytes()
    total += len(flat)
    digest.update(data)
    fh.write(data)
    return total


# ---- the whole run ------------------------------------------------------------------------


def _done(root: Path, name: str, key: str, dtype: str) -> dict[str, Any] | None:
    """The record of shard ``name`` if it is complete and made of the same key."""
    try:
        record = json.loads((root / f"{name}.json").read_text())
        size = (root / f"{name}.bin").stat().st_size
    except (OSError, ValueError):
        return None
    if record.get("key") != key or size != record["tokens"] * itemsize(dtype):
        return None
    if not (root / f"{name}.idx.npy").is_file():
        return None
    return record


def _clean(root: Path, keep: int) -> None:
    """Delete temporary files, and shards numbered ``keep`` and up (of an older, larger run)."""
    for p in root.iterdir():
        stale = p.name.startswith("shard_") and int(p.name[6:11]) >= keep
        if stale or p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)


def _run_jobs(jobs: list[ShardJob], text: str, cfg: PrepareConfig, bar) -> list[dict]:
    sizes = {job.name: sum(s.size for s in job.sources) for job in jobs}
    out = []
    if cfg.workers == 1 or len(jobs) <= 1:
        _init_worker(text)
        for job in jobs:
            out.append(build_shard(job))
            bar.update(sizes[job.name])
        return out
    # spawn: a fork would inherit the parent's tokenizers thread pool (it warns and goes
    # serial); one single-threaded tokenizer per process uses the cores without oversubscribing
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(cfg.workers, len(jobs)), _init_worker, (text, True)) as pool:
        for record in pool.imap_unordered(build_shard, jobs):
            out.append(record)
            bar.update(sizes[record["name"]])
    return out


def prepare(cfg: PrepareConfig) -> dict[str, Any]:
    """Run ``cfg``; returns the metadata written (plus ``seconds`` and ``reused_shards``).

    Raises:
        FileNotFoundError, ValueError: bad inputs or options (one line naming the file and the
            rule; with ``skip_bad`` bad documents are counted instead).
        PrepareError: a write failed (a full disk); the directory holds no metadata then.
    """
    t0 = time.perf_counter()
    root = Path(cfg.out)
    root.mkdir(parents=True, exist_ok=True)
    (root / META_NAME).unlink(missing_ok=True)  # from here on the directory is not valid
    sources = find_sources(cfg.inputs, cfg.format, split=cfg.split, shard_bytes=cfg.shard_bytes)
    text = _tokenizer_text(sources, cfg, root)
    from tokenizers import Tokenizer

    info = describe_tokenizer(
        Tokenizer.from_str(text), text, cfg.tokenizer or "(trained BPE)", cfg.eos
    )
    _write_tokenizer(root, text, cfg, sources)
    dtype = dtype_for(info.vocab_size)
    groups = _plan(sources, cfg.shard_bytes)
    common = [info.sha256, info.eos_id, dtype, cfg.field, cfg.skip_bad]
    jobs = [
        ShardJob(
            root=str(root),
            name=shard_name(i),
            sources=tuple(group),
            key=_key([*common, [s.key() for s in group]]),
            field=cfg.field,
            skip_bad=cfg.skip_bad,
            eos_id=info.eos_id,
            dtype=dtype,
        )
        for i, group in enumerate(groups)
    ]
    _clean(root, len(jobs))
    records = {}
    for job in jobs:
        record = _done(root, job.name, job.key, dtype)
        if record is not None:
            records[job.name] = record
    todo = [job for job in jobs if job.name not in records]
    from tqdm import tqdm

    total = sum(s.size for s in sources)
    done_bytes = total - sum(s.size for job in todo for s in job.sources)
    with tqdm(
        total=total,
        initial=done_bytes,
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not cfg.progress,
        file=sys.stderr,
    ) as bar:
        try:
            for record in _run_jobs(todo, text, cfg, bar):
                records[record["name"]] = record
        except BaseException:
            _clean(root, len(jobs))  # temporary files of the shards in flight
            raise
    meta = _metadata(cfg, info, dtype, [records[job.name] for job in jobs])
    if meta["tokens"] == 0:
        raise ValueError(f"the inputs hold no document to train on ({_skipped_line(meta)})")
    write_json_atomic(root / META_NAME, meta)
    return {**meta, "seconds": time.perf_counter() - t0, "reused_shards": len(jobs) - len(todo)}


def _write_tokenizer(root: Path, text: str, cfg: PrepareConfig, sources: list[Source]) -> None:
    path = root / TOKENIZER_NAME
    try:
        same = path.read_text(encoding="utf-8") == text
    except (OSError, UnicodeDecodeError):
        same = False
    try:
        if not same:
            data = text.encode("utf-8")
            write_atomic(path, lambda fh: fh.write(data))
        if cfg.tokenizer is None:
            key = _key([cfg.vocab_size, cfg.train_bytes, cfg.field, [s.key() for s in sources]])
            write_json_atomic(root / TRAIN_RECORD, {"key": key, "vocab_size": cfg.vocab_size})
    except OSError as exc:
        raise PrepareError(f"writing {path} failed: {exc.strerror or exc}") from None


def _metadata(
    cfg: PrepareConfig, info: TokenizerInfo, dtype: str, records: list[dict]
) -> dict[str, Any]:
    skipped: dict[str, list] = {}
    for r in records:
        for reason, (count, first) in r["skipped"].items():
            entry = skipped.setdefault(reason, [0, first])
            entry[0] += count
    return {
        "format": FORMAT,
        "tokenizer": info.to_dict(),
        "dtype": dtype,
        "tokens": sum(r["tokens"] for r in records),
        "documents": sum(r["documents"] for r in records),
        "bytes": sum(r["bytes"] for r in records),
        "skipped": {k: {"count": c, "first": f} for k, (c, f) in skipped.items()},
        "shards": [
            {k: r[k] for k in ("name", "tokens", "documents", "bytes", "sha256")} for r in records
        ],
        "inputs": {"paths": list(cfg.inputs), "format": cfg.format, "field": cfg.field},
    }


def _skipped_line(meta: dict[str, Any]) -> str:
    skipped = meta["skipped"]
    if not skipped:
        return "no document at all"
    parts = [f"{v['count']} skipped: {k} (first: {v['first']})" for k, v in skipped.items()]
    return "; ".join(parts)
