"""The tokenizer of a prepared corpus: HF ``tokenizers``, a given file or a BPE trained here.

A prepared directory holds the tokenizer as ``tokenizer.json`` (the ``tokenizers`` format that
``transformers.PreTrainedTokenizerFast`` reads too); its sha256 names it everywhere (metadata,
checkpoints, messages). Every document is followed by the end-of-document token (EOS), so the
tokenizer must have one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# Tried in order when no --eos is given (GPT-2 / Qwen, Llama 3, Llama 2 / Mistral, others).
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
TRAINED_EOS = "<|endoftext|>"


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """What the metadata and the checkpoints record of a tokenizer."""

    sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
        }


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_tokenizer_text(path: str):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json's text at ``path``, and the text.

    Raises:
        ValueError: the file is not a tokenizers JSON file (one line naming it).
    """
    from tokenizers import Tokenizer

    with open(path, "rb") as fh:  # OSError (missing, unreadable) passes through as it is
        raw = fh.read()
    try:
        text = raw.decode("utf-8")
        return Tokenizer.from_str(text), text
    except Exception as exc:  # UnicodeDecodeError, tokenizers' parse errors (Exception)
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        raise ValueError(f"tokenizer {path} is not a tokenizers JSON file ({first})") from None


def describe_tokenizer(tok, text: str, path: str, eos: str | None) -> TokenizerInfo:
    """The sha256 of ``text``, the vocabulary size (added tokens included) and the EOS id.

    Raises:
        ValueError: ``eos`` (or, when None, every one of :data:`EOS_CANDIDATES`) is not a token.
    """
    names = (eos,) if eos is not None else EOS_CANDIDATES
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return TokenizerInfo(sha256_text(text), tok.get_vocab_size(True), tid, name)
    if eos is not None:
        raise ValueError(f"tokenizer {path} has no token {eos!r} (--eos)")
    raise ValueError(
        f"tokenizer {path} has none of the end-of-document tokens {', '.join(EOS_CANDIDATES)}; "
        "name its own with --eos"
    )


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` = id 0, then the 256 bytes,
    then merges) trained on ``texts``, as tokenizer.json text.

    Byte-level (GPT-2's scheme): any text encodes without unknown tokens and decodes back to
    the same string.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(
            f"vocab_size ({vocab_size}) must be an integer >= 257 (the 256 bytes and EOS)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


def byte_tokenizer_text() -> str:
    """tokenizer.json text of moesaic's byte data: token id b is byte b (ids 0-255).

    A byte-level BPE without merges whose vocabulary lists GPT-2's printable stand-in of byte
    b at id b, so ``transformers`` can encode and decode what a byte run learned.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the ByteLevel pre-tokenizer's)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out
