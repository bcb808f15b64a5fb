"""The on-disk format of a prepared corpus, and its checks.

Layout of a prepared directory ``OUT``::

    tokenizer.json           the tokenizer (HF tokenizers format)
    shard_00000.bin          flat token ids, native byte order, uint16 when the vocabulary fits
                             (<= 65536 ids), else uint32; every document followed by EOS
    shard_00000.idx.npy      int64 [documents, 2]: each document's end (exclusive, in tokens,
                             within the shard, its EOS included) and its size in UTF-8 bytes
    shard_00000.json         the shard's record (counts, sha256, the key of its inputs)
    moesaic-data.json        the metadata: format, tokenizer (sha256, vocabulary, EOS), dtype,
                             every shard's counts, totals; written last

Every file is written to ``NAME.tmp`` and moved into place with ``os.replace``; a shard's record
follows its two data files and the metadata follows every shard, so a directory with a
``moesaic-data.json`` is complete, and an interrupted ``prepare`` leaves none (it deletes the
old one before changing anything).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from moesaic.data.tokenizer import TokenizerInfo, sha256_text

META_NAME = "moesaic-data.json"
TOKENIZER_NAME = "tokenizer.json"
FORMAT = 1
# uint16 holds ids 0..65535: a vocabulary of up to 65536 tokens.
UINT16_VOCAB = 1 << 16


def dtype_for(vocab_size: int) -> str:
    """``uint16`` when every id of a ``vocab_size`` vocabulary fits, else ``uint32``."""
    return "uint16" if vocab_size <= UINT16_VOCAB else "uint32"


def itemsize(dtype: str) -> int:
    return {"uint16": 2, "uint32": 4}[dtype]


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


def write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` through ``write(fh)`` into ``path.tmp``, fsync, then ``os.replace``.

    A failure (a full disk: ``OSError(ENOSPC)``) removes the temporary file and propagates;
    ``path`` is then either absent or its previous complete version.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    data = (json.dumps(obj, indent=1) + "\n").encode()
    write_atomic(path, lambda fh: fh.write(data))


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """One shard's counts: tokens (EOS included), documents, UTF-8 bytes of their text."""

    name: str
    tokens: int
    documents: int
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "tokens": self.tokens,
            "documents": self.documents,
            "bytes": self.bytes,
            "sha256": self.sha256,
        }


@dataclass(frozen=True, slots=True)
class PreparedCorpus:
    """A checked prepared directory (:func:`read_prepared`)."""

    root: Path
    tokenizer: TokenizerInfo
    dtype: str
    shards: tuple[ShardInfo, ...]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    def bin_path(self, shard: ShardInfo) -> Path:
        return self.root / f"{shard.name}.bin"

    def idx_path(self, shard: ShardInfo) -> Path:
        return self.root / f"{shard.name}.idx.npy"

    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data (and a resume compares)."""
        return {
            "kind": "tokens",
            "tokenizer": self.tokenizer.to_dict(),
            "dtype": self.dtype,
            "tokens": self.tokens,
            "documents": self.documents,
        }


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a directory written by ``moesaic prepare`` (its metadata exists)."""
    return (Path(path) / META_NAME).is_file()


def check_not_unfinished(path: str | os.PathLike[str]) -> None:
    """ValueError if ``path`` is a directory ``prepare`` began and did not finish (shard files,
    no metadata): read as text it would train on the shards' bytes."""
    root = Path(path)
    if root.is_dir() and not is_prepared(root) and any(root.glob("shard_*.bin*")):
        raise ValueError(
            f"data {path} holds token shards but no {META_NAME}: `moesaic prepare` did not "
            "finish there (interrupted or failed); run it again"
        )


def read_metadata(root: Path) -> dict[str, Any]:
    """The metadata of ``root`` (ValueError, one line, when it is absent or not ours)."""
    path = root / META_NAME
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise ValueError(f"{path} has format {fmt!r}; this moesaic reads format {FORMAT}")
    return meta


def read_prepared(root: str | os.PathLike[str]) -> PreparedCorpus:
    """Open and check a prepared directory (sizes, not contents: cheap at any corpus size).

    Raises:
        ValueError: one line naming the file and the rule: the metadata is missing or of
            another format, tokenizer.json is not the one the metadata names (sha256), a
            shard's file is missing or its size is not its token count times the dtype's size
            (truncated), a document index is missing or disagrees with its shard.
    """
    root = Path(root)
    meta = read_metadata(root)
    tok = TokenizerInfo(**meta["tokenizer"])
    tok_path = root / TOKENIZER_NAME
    try:
        got = sha256_text(tok_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{tok_path} cannot be read: {exc}") from None
    if got != tok.sha256:
        raise ValueError(
            f"{tok_path} has sha256 {got[:12]}..., the metadata {META_NAME} names "
            f"{tok.sha256[:12]}...: the directory was changed after prepare; prepare it again"
        )
    corpus = PreparedCorpus(root, tok, meta["dtype"], tuple(ShardInfo(**s) for s in meta["shards"]))
    size = itemsize(corpus.dtype)
    for shard in corpus.shards:
        check_shard_size(corpus.bin_path(shard), shard.tokens, corpus.dtype, size)
        idx = corpus.idx_path(shard)
        if not idx.is_file():
            raise ValueError(f"{idx} is missing: every shard needs its document index")
    if not corpus.shards or corpus.tokens == 0:
        raise ValueError(f"{root / META_NAME} lists no tokens")
    return corpus


def check_shard_size(path: Path, tokens: int, dtype: str, size: int) -> None:
    """ValueError unless ``path`` holds exactly ``tokens`` ids of ``size`` bytes."""
    try:
        have = path.stat().st_size
    except OSError as exc:
        raise ValueError(f"shard {path} cannot be read: {exc.strerror}") from None
    if have != tokens * size:
        what = "truncated" if have < tokens * size else "longer than recorded"
        raise ValueError(
            f"shard {path} is {what}: {have} bytes, the metadata says {tokens} {dtype} tokens "
            f"= {tokens * size} bytes; prepare the corpus again"
        )


def token_vocab_size(data: object) -> int | None:
    """The tokenizer's vocabulary of a prepared directory ``data``; None for anything else
    (a text file or directory: bytes)."""
    if not isinstance(data, str) or not is_prepared(data):
        return None
    return int(read_metadata(Path(data))["tokenizer"]["vocab_size"])
