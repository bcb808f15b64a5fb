"""Text <-> token ids for a checkpoint: bytes (ids 0-255), or the tokenizer the run trained with.

A token run's checkpoint holds its tokenizer (``meta["tokenizer_json"]``, see
:mod:`moesaic.train.data_source`); its sha256 must be the one recorded in ``meta["data"]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moesaic.data.tokenizer import sha256_text


@dataclass(frozen=True, slots=True)
class Codec:
    """Encode and decode a checkpoint's text.

    Attributes:
        tokenizer: a ``tokenizers.Tokenizer``; None: bytes.
        vocab_size: ids a sample may take (256 for bytes).
        eos_id: the end-of-document id (None for bytes: generation never stops early).
    """

    tokenizer: Any
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            # A command line with bytes that are not UTF-8 reaches Python as lone surrogates:
            # send those bytes back as they were (the model is byte-level).
            return list(text.encode("utf-8", errors="surrogateescape"))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The ids a generation starts from: the prompt's, or for an empty prompt a newline
        (bytes) or EOS (tokens: the start of a document)."""
        ids = self.encode(prompt)
        if ids:
            return ids
        return [10] if self.eos_id is None else [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    def until_eos(self, ids: list[int]) -> list[int]:
        """``ids`` up to and including the first EOS (what a generation stopping there gives)."""
        if self.eos_id is None or self.eos_id not in ids:
            return ids
        return ids[: ids.index(self.eos_id) + 1]


def codec_of(meta: dict[str, Any], where: str) -> Codec:
    """The codec of a checkpoint's ``meta``; ValueError (naming ``where``) when its tokenizer
    is missing or not the one its data record names."""
    data = meta.get("data", {"kind": "bytes"})
    if data.get("kind") != "tokens":
        return Codec(None, 256, None)
    text = meta.get("tokenizer_json")
    want = data["tokenizer"]["sha256"]
    if not isinstance(text, str) or sha256_text(text) != want:
        raise ValueError(
            f"checkpoint {where}: its tokenizer is missing or not the one it was trained with "
            f"(sha256 {want})"
        )
    from tokenizers import Tokenizer

    return Codec(
        Tokenizer.from_str(text),
        int(data["tokenizer"]["vocab_size"]),
        int(data["tokenizer"]["eos_id"]),
    )
