"""Training on token shards of ``moesaic prepare``: memory-mapped, packed, split by documents.

Shape legend: B sequences per rank, T sequence length (windows hold T + 1 tokens).

The shards are one stream of token ids (documents in order, EOS after each: concat-then-split
packing), memory-mapped read-only (``mmap`` viewed by NumPy, as ``numpy.memmap`` does, so that
the kernel can be advised: random access without read-ahead, and the pages a window's read
mapped released right after it is copied): a rank's resident memory never holds the corpus,
nor the pages of the windows it read (measured flat in corpus size: docs/training.md). The last documents (at least ``val_fraction`` of the tokens, whole
documents) are validation; the rest is cut into non-overlapping windows of T + 1 tokens exactly
as the byte corpus is (:mod:`moesaic.train.data`), and sampled the same way: global sample
``consumed + rank * B + j`` is window ``perm_epoch(pos)`` with ``epoch, pos = divmod(sample,
windows)``, so the data position stays one integer across checkpoints and world sizes.

``perm_epoch`` is a keyed pseudo-random permutation (a 4-round Feistel network on the smallest
power-of-4 domain holding the windows, cycle-walking back into range), computed per sample: no
per-epoch array of windows, so memory does not grow with the corpus either.

A shard that changes under a running job (another size, mtime or inode than at the start) is
refused when a batch reads it, naming the file: a memory map of a truncated file would end the
process with SIGBUS instead.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moesaic.data.shards import PreparedCorpus
from moesaic.train.data import WindowedData

_M64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 4
# The pages a window's read mapped are released in aligned blocks of this size: on a read
# fault the kernel maps cached neighbours too (64 KiB of "fault-around", or a whole large folio
# of the page cache, up to 2 MiB: reading one window of 258 bytes mapped 64-960 KiB on this
# project's machine, Linux 6.18), so the whole block goes back.
_RELEASE_BLOCK = 2 * 1024 * 1024


def _mix64(v: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of ``v``."""
    z = (v + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def permuted_index(pos: int, n: int, key: int) -> int:
    """Where ``pos`` goes in a pseudo-random permutation of ``range(n)`` drawn from ``key``.

    A bijection of ``range(n)`` for every ``key`` (tested exhaustively on small ``n``): a
    Feistel network is a bijection of its domain ``[0, 4**h)``, and cycle-walking (applying it
    again until the value is below ``n``) restricts a bijection to ``range(n)``; the domain is
    under 4 n, so under 4 rounds of walking are expected.
    """
    half = max(1, math.ceil(max(1, (n - 1).bit_length()) / 2))
    mask = (1 << half) - 1
    x = pos
    while True:
        left, right = x >> half, x & mask
        for r in range(_FEISTEL_ROUNDS):
            left, right = right, left ^ (_mix64(_mix64(key * 4 + r) ^ right) & mask)
        x = (left << half) | right
        if x < n:
            return x


@dataclass(frozen=True, slots=True)
class _Shard:
    path: Path
    start: int  # global offset of its first token
    tokens: np.ndarray  # a read-only view of ``mapping``
    mapping: mmap.mmap
    stat: tuple[int, int, int]  # size, mtime_ns, inode at open

    def release(self, lo_byte: int, hi_byte: int) -> None:
        """Unmap (``MADV_DONTNEED``) the pages of bytes ``[lo_byte, hi_byte)`` from this
        process: the file's pages stay in the page cache, the process' resident size does not
        keep them (the next read maps them again)."""
        a = lo_byte // _RELEASE_BLOCK * _RELEASE_BLOCK
        b = min(len(self.mapping), -(-hi_byte // _RELEASE_BLOCK) * _RELEASE_BLOCK)
        self.mapping.madvise(mmap.MADV_DONTNEED, a, b - a)


def _map(path: Path, dtype: str, tokens: int) -> tuple[np.ndarray, mmap.mmap]:
    """A read-only memory map of ``path`` as ``tokens`` ids (``numpy.memmap``'s mapping, made
    here to advise the kernel: random access, no read-ahead)."""
    with open(path, "rb") as fh:
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    mapping.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapping, dtype=dtype, count=tokens), mapping


def _stat(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


class TokenStream:
    """Every shard of a prepared corpus as one read-only stream of token ids."""

    def __init__(self, corpus: PreparedCorpus) -> None:
        self.corpus = corpus
        shards, start = [], 0
        for info in corpus.shards:
            if info.tokens == 0:
                continue  # every document of it was skipped
            path = corpus.bin_path(info)
            tokens, mapping = _map(path, corpus.dtype, info.tokens)
            shards.append(_Shard(path, start, tokens, mapping, _stat(path)))
            start += info.tokens
        self._shards = shards
        self._starts = np.array([s.start for s in shards], dtype=np.int64)
        self.tokens = start

    def check(self, shard: _Shard) -> None:
        """ValueError if ``shard``'s file is not the one opened (changed under the job)."""
        try:
            now = _stat(shard.path)
        except OSError as exc:
            raise ValueError(
                f"shard {shard.path} changed while training: it cannot be read any more "
                f"({exc.strerror}); never rewrite a prepared directory a job reads"
            ) from None
        if now != shard.stat:
            raise ValueError(
                f"shard {shard.path} changed while training (size {shard.stat[0]} -> {now[0]} "
                "bytes, or its mtime or inode): never rewrite a prepared directory a job reads; "
                "prepare into a new one"
            )

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens ``[start, start + n)`` as int64 (crossing shard boundaries as needed)."""
        out = np.empty(n, dtype=np.int64)
        i = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < n:
            shard = self._shards[i]
            self.check(shard)
            lo = start + done - shard.start
            take = min(n - done, len(shard.tokens) - lo)
            out[done : done + take] = shard.tokens[lo : lo + take]
            size = shard.tokens.itemsize
            shard.release(lo * size, (lo + take) * size)
            done += take
            i += 1
        return out


class TokenData(WindowedData):
    """Non-overlapping windows of ``seq_len + 1`` tokens of one split of a :class:`TokenStream`
    (the interface of :class:`moesaic.train.data.PackedData`).

    Args:
        stream: the corpus.
        start, stop: the split's tokens ``[start, stop)``.
        seq_len: T.
        name: "train" or "validation" (for messages).
        nbytes: UTF-8 bytes of the split's documents (for bits per byte).
    """

    def __init__(
        self, stream: TokenStream, start: int, stop: int, seq_len: int, name: str, nbytes: int
    ) -> None:
        n = (stop - start - 1) // seq_len
        if n < 1:
            raise ValueError(
                f"the {name} split of {stream.corpus.root} has {stop - start} tokens, fewer than "
                f"seq_len + 1 ({seq_len + 1}); give more data, a smaller seq_len or another "
                "val_fraction"
            )
        self.stream, self.start, self.seq_len, self.num_windows = stream, start, seq_len, n
        self.bytes_per_token = nbytes / (stop - start)

    def windows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [B, T] int64, of the windows ``idx``."""
        T = self.seq_len
        rows = [self.stream.read(self.start + int(i) * T, T + 1) for i in idx.tolist()]
        w_BS = torch.from_numpy(np.stack(rows))
        return w_BS[:, :-1], w_BS[:, 1:]

    def window_of(self, epoch: int, pos: int, seed: int) -> int:
        """Epoch ``epoch``'s order, computed per position (no array that grows with the corpus)."""
        return permuted_index(pos, self.num_windows, seed * 1_000_003 + epoch)


def _document_split(corpus: PreparedCorpus, val_fraction: float) -> tuple[int, int]:
    """(split, validation bytes): the global token offset where the validation documents start
    (the last document boundary leaving at least ``val_fraction`` of the tokens after it)."""
    total = corpus.tokens
    target = total - max(1, math.ceil(total * val_fraction))
    offset, split, val_bytes = total, 0, 0
    for info in reversed(corpus.shards):
        offset -= info.tokens
        if info.tokens == 0:
            continue
        idx = np.load(corpus.idx_path(info), mmap_mode="r")
        ends, nbytes = idx[:, 0], idx[:, 1]
        bounds = np.concatenate([[0], ends[:-1]]) + offset  # each document's start
        k = int(np.searchsorted(bounds, target, side="right")) - 1  # last start <= target
        if k >= 0:
            split = int(bounds[k])
            val_bytes += int(nbytes[k:].sum())
            break
        val_bytes += int(nbytes.sum())
    if split == 0:
        raise ValueError(
            f"{corpus.root}: validation is held out by whole documents, and its "
            f"{corpus.documents} document(s) leave none for training with val_fraction "
            f"{val_fraction}; give more documents or a smaller val_fraction"
        )
    return split, val_bytes


def load_token_splits(
    corpus: PreparedCorpus, val_fraction: float, seq_len: int
) -> tuple[TokenData, TokenData]:
    """(train, validation) of a prepared corpus (validation: its last whole documents)."""
    stream = TokenStream(corpus)
    split, val_bytes = _document_split(corpus, val_fraction)
    total_bytes = sum(s.bytes for s in corpus.shards)
    train = TokenData(stream, 0, split, seq_len, "train", total_bytes - val_bytes)
    val = TokenData(stream, split, stream.tokens, seq_len, "validation", val_bytes)
    return train, val
