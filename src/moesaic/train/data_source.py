"""Which data a run trains on: bytes of text (``moesaic.train.data``) or the token shards of
``moesaic prepare`` (``moesaic.train.tokens``), and whether a checkpoint was trained on the same.

A checkpoint records the data's identity (``meta["data"]``: ``{"kind": "bytes"}``, or the
tokenizer's sha256, vocabulary, EOS and the corpus' counts) and, for token data, the tokenizer
itself (``meta["tokenizer_json"]``, covered by the checkpoint's manifest), so that ``generate``
and ``export`` encode and decode with it and a resume on another tokenizer's shards is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moesaic.data.shards import TOKENIZER_NAME, check_not_unfinished, is_prepared, read_prepared
from moesaic.train.data import PackedData, load_splits
from moesaic.train.tokens import TokenData, load_token_splits

BYTES = {"kind": "bytes"}


@dataclass(frozen=True, slots=True)
class TrainingData:
    """A run's splits, what checkpoints record of them, and the tokenizer's text (tokens)."""

    train: PackedData | TokenData
    val: PackedData | TokenData
    identity: dict[str, Any]
    tokenizer_json: str | None

    def bits_per_byte(self, val_loss: float) -> float:
        """Validation loss (nats per token) as bits per UTF-8 byte of the validation text."""
        return val_loss / math.log(2) / self.val.bytes_per_token

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint's meta.json gets: ``data`` and, for tokens, ``tokenizer_json``."""
        out: dict[str, Any] = {"data": self.identity}
        if self.tokenizer_json is not None:
            out["tokenizer_json"] = self.tokenizer_json
        return out


def open_training_data(
    data: str | None, max_bytes: int, val_fraction: float, seq_len: int
) -> TrainingData:
    """The splits of ``data``: a prepared directory's token shards, else text as bytes."""
    if data is not None:
        check_not_unfinished(data)
    if data is not None and is_prepared(data):
        corpus = read_prepared(data)
        train, val = load_token_splits(corpus, val_fraction, seq_len)
        text = (corpus.root / TOKENIZER_NAME).read_text(encoding="utf-8")
        return TrainingData(train, val, corpus.identity(), text)
    train_b, val_b = load_splits(data, max_bytes, val_fraction, seq_len)
    return TrainingData(train_b, val_b, dict(BYTES), None)


def data_identity(data: str | None) -> dict[str, Any]:
    """What a checkpoint records of ``data`` (see :class:`TrainingData`), from its metadata
    alone: the launcher checks a resume against it before any worker starts."""
    if data is not None and is_prepared(data):
        return read_prepared(data).identity()
    return dict(BYTES)


def _describe(identity: dict[str, Any]) -> str:
    if identity.get("kind") != "tokens":
        return "bytes"
    return f"tokens of tokenizer sha256 {identity['tokenizer']['sha256']}"


def check_resume_data(
    path: Path, meta: dict[str, Any], identity: dict[str, Any], where: str
) -> None:
    """Refuse to resume checkpoint ``path`` on data of another tokenizer (or bytes on tokens),
    naming both; a checkpoint without ``data`` (older) was trained on bytes. ``identity`` is
    the data's (:func:`data_identity`, ``TrainingData.identity``)."""
    saved = meta.get("data", BYTES)
    mine = identity
    same_kind = saved.get("kind") == mine.get("kind")
    if same_kind and mine.get("kind") != "tokens":
        return
    if same_kind and saved["tokenizer"]["sha256"] == mine["tokenizer"]["sha256"]:
        return
    raise ValueError(
        f"checkpoint {path} was trained on {_describe(saved)}, but data {where} are "
        f"{_describe(mine)}: resume on the data the run was trained on"
    )
