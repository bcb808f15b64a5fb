"""The inputs of ``moesaic prepare``, read as documents.

A *source* is one input file (or a row range of a ``datasets`` dataset); it yields documents
(strings). Formats:

* ``text``: every file is one document, read as strict UTF-8;
* ``jsonl``: every non-blank line is a JSON object whose ``field`` (default ``text``) is one
  document;
* ``parquet``: the column ``field`` of every row (needs ``pyarrow``);
* ``dataset``: a directory written by ``datasets.Dataset.save_to_disk``, the column ``field``
  (needs ``datasets``).

A document that breaks a rule (an empty or non-UTF-8 file, a JSONL line without the field, ...)
raises :class:`BadInput`, one line naming the file (and line) and the rule; with ``skip_bad`` it
is skipped and counted instead, by reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("auto", "text", "jsonl", "parquet", "dataset")
# Files datasets.Dataset.save_to_disk writes; a directory holding one is a dataset.
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class BadInput(ValueError):
    """One input document that breaks a rule; the message names the file and the rule."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # the rule alone, to count skipped documents by

    def __reduce__(self):  # picklable across worker processes with both arguments
        return (type(self), (str(self), self.reason))


@dataclass(frozen=True, slots=True)
class Source:
    """One unit of input: a file, or rows ``[start, stop)`` of a dataset directory.

    ``size`` (bytes on disk; a dataset's share of its arrow files) balances the shards;
    ``mtime_ns`` makes a changed file a new source (its shard is rebuilt on a rerun).
    """

    path: str
    kind: str
    size: int
    mtime_ns: int
    start: int = 0
    stop: int = -1

    def key(self) -> list:
        return [self.path, self.kind, self.size, self.mtime_ns, self.start, self.stop]


def _need(module: str, what: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs the {module} package (pip install {module})")


def _walk(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
    return files


def _kind_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    if path.suffix == ".jsonl":
        return "jsonl"
    if path.suffix == ".parquet":
        return "parquet"
    return "text"


def _is_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in _DATASET_MARKERS)


def find_sources(
    inputs: list[str], fmt: str = "auto", *, split: str | None = None, shard_bytes: int = 0
) -> list[Source]:
    """Every input file (directories walked in sorted order, hidden entries skipped).

    Args:
        inputs: files and directories, in the order their documents are concatenated.
        fmt: one of :data:`FORMATS`; ``auto`` goes by the suffix (``.jsonl``, ``.parquet``, else
            text) and takes a directory written by ``save_to_disk`` as a dataset.
        split: the split of a saved ``DatasetDict``.
        shard_bytes: cut a dataset into sources of about this many bytes of its arrow files
            (0: one source).

    Raises:
        FileNotFoundError: an input does not exist.
        ValueError: an input holds no file, or a format's package is missing.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out: list[Source] = []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"input {item} does not exist")
        if fmt == "dataset" or (fmt == "auto" and _is_dataset_dir(path)):
            out += _dataset_sources(path, split, shard_bytes)
            continue
        files = _walk(path) if path.is_dir() else [path]
        if not files:
            raise ValueError(f"input {item} is a directory with no (non-hidden) file")
        for f in files:
            st = f.stat()
            out.append(Source(str(f), _kind_of(f, fmt), st.st_size, st.st_mtime_ns))
    for kind, module in (("parquet", "pyarrow"), ("dataset", "datasets")):
        if any(s.kind == kind for s in out):
            _need(module, f"reading {kind} input")
    return out


def _load_dataset(path: str, split: str | None):
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise ValueError(
                f"dataset {path} holds the splits {', '.join(ds)}: choose one with --split "
                f"(got {split!r})"
            )
        return ds[split]
    if split is not None:
        raise ValueError(f"dataset {path} has no splits; drop --split {split}")
    return ds


def _dataset_sources(path: Path, split: str | None, shard_bytes: int) -> list[Source]:
    _need("datasets", f"reading the dataset {path}")
    ds = _load_dataset(str(path), split)
    rows = len(ds)
    if rows == 0:
        raise ValueError(f"dataset {path} is empty: no rows")
    size = sum(f.stat().st_size for f in _walk(path))
    mtime = max(f.stat().st_mtime_ns for f in _walk(path))
    step = rows if shard_bytes <= 0 else max(1, rows * shard_bytes // max(1, size))
    kind = "dataset" if split is None else f"dataset:{split}"
    return [
        Source(
            str(path), kind, size * (min(rows, a + step) - a) // rows, mtime, a, min(rows, a + step)
        )
        for a in range(0, rows, step)
    ]


def _strict_text(data: bytes, where: str) -> str | BadInput:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadInput(
            f"{where}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); every "
            "input must be UTF-8 text",
            "not UTF-8",
        )


def _check_text(text: object, where: str, field: str) -> str | BadInput:
    if not isinstance(text, str):
        return BadInput(
            f"{where}: field {field!r} is {type(text).__name__}, not a string",
            f"field {field!r} not a string",
        )
    if not text.strip():
        return BadInput(f"{where}: empty text in field {field!r}", "empty text")
    return text


# A reader yields each document, or the BadInput that stands for a bad one (never raised
# there: the reader goes on with the next line or row when bad documents are skipped).
Doc = str | BadInput


def _text_docs(src: Source, field: str) -> Iterator[Doc]:
    data = Path(src.path).read_bytes()
    if not data.strip():
        yield BadInput(f"{src.path}: empty file (a document needs text)", "empty file")
        return
    yield _strict_text(data, src.path)


def _jsonl_line(raw: bytes, where: str, field: str) -> Doc:
    line = _strict_text(raw, where)
    if isinstance(line, BadInput):
        return line
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return BadInput(f"{where}: not JSON ({exc.msg})", "not JSON")
    if not isinstance(obj, dict) or field not in obj:
        return BadInput(
            f"{where}: no field {field!r} (every JSONL line needs its text there: --field)",
            f"no field {field!r}",
        )
    return _check_text(obj[field], where, field)


def _jsonl_docs(src: Source, field: str) -> Iterator[Doc]:
    with open(src.path, "rb") as fh:
        seen = False
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                seen = True
                yield _jsonl_line(raw, f"{src.path}:{lineno}", field)
    if not seen:
        yield BadInput(f"{src.path}: empty file (no JSONL line)", "empty file")


def _no_column(path: str, field: str, names: list[str]) -> BadInput:
    return BadInput(
        f"{path}: no column {field!r} (the text column, --field); it has {', '.join(names)}",
        f"no column {field!r}",
    )


def _parquet_docs(src: Source, field: str) -> Iterator[Doc]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(src.path)
    except pa.ArrowException as exc:
        yield BadInput(
            f"{src.path}: not a parquet file ({str(exc).splitlines()[0]})", "not parquet"
        )
        return
    if field not in pf.schema_arrow.names:
        yield _no_column(src.path, field, pf.schema_arrow.names)
        return
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield _check_text(text, f"{src.path} row {row}", field)
            row += 1


def _dataset_docs(src: Source, field: str) -> Iterator[Doc]:
    split = src.kind.partition(":")[2] or None
    ds = _load_dataset(src.path, split)
    if field not in ds.column_names:
        yield _no_column(src.path, field, ds.column_names)
        return
    for a in range(src.start, src.stop, 1024):
        b = min(src.stop, a + 1024)
        for i, text in enumerate(ds[a:b][field]):
            yield _check_text(text, f"{src.path} row {a + i}", field)


_READERS: dict[str, Callable[[Source, str], Iterator[Doc]]] = {
    "text": _text_docs,
    "jsonl": _jsonl_docs,
    "parquet": _parquet_docs,
    "dataset": _dataset_docs,
}


def documents(src: Source, field: str, skipped: dict[str, list] | None = None) -> Iterator[str]:
    """The documents of ``src``.

    Args:
        src: the source.
        field: the text field of JSONL, parquet and dataset rows.
        skipped: None: a bad document raises :class:`BadInput`. A dict: bad documents (a text
            file, a JSONL line, a row) are skipped and recorded in it as
            ``{reason: [count, first message]}``.
    """
    for doc in _READERS[src.kind.partition(":")[0]](src, field):
        if isinstance(doc, str):
            yield doc
        elif skipped is None:
            raise doc
        else:
            entry = skipped.setdefault(doc.reason, [0, str(doc)])
            entry[0] += 1
