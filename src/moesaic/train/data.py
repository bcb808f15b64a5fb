"""The corpus, sequence packing and deterministic per-rank sharding.

Shape legend: B sequences per rank, T sequence length (windows hold T + 1 bytes: input and the
shifted target).

The corpus is one byte stream (files in sorted order, joined by a blank line), cut into
non-overlapping windows of T + 1 bytes (packing: no padding, documents run across windows). The
tail ``val_fraction`` of the stream is validation. Training visits windows in a per-epoch
permutation drawn from ``seed + epoch``; the global sample index ``consumed + rank * B + j`` picks
rank ``rank``'s j-th sequence, so the data position is one integer (``consumed``) that survives
checkpoints and changes of the world size.
"""

from __future__ import annotations

import errno
import os
import stat
import sysconfig
from pathlib import Path

import torch

SEPARATOR = b"\n\n"


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted walk, third-party packages and caches skipped: the same list on every machine
        # with the same Python.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files


def _kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, name in (
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _why_not(path: Path) -> str | None:
    """Why ``path`` cannot be read as text (None: a regular file that ``stat`` accepts).

    ``stat`` follows links, so a loop, a dangling link and a missing permission on the way are
    named here; the file itself is opened non-blocking later (a FIFO swapped in meanwhile cannot
    block the launcher either).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return _os_reason(exc)
    return None if stat.S_ISREG(mode) else f"not a regular file ({_kind(mode)})"


def _os_reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "a symlink loop"
    if exc.errno == errno.ENOENT:
        return "a dangling link"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return exc.strerror or type(exc).__name__


def _read_regular(path: Path, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``path``, opened without blocking and checked to be a regular
    file on the descriptor itself (a FIFO would block ``open`` forever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file ({_kind(mode)})")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(limit)
    finally:
        os.close(fd)


def _user_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
    return files


def _skipped_line(data: str, skipped: list[tuple[Path, str]], total: int) -> str:
    """``data path D: skipped 2 of 5 files: 1 permission denied (a.txt), 1 not a regular file
    (a named pipe) (fifo)``: the count, each reason with its first file."""
    by_reason: dict[str, list[Path]] = {}
    for f, why in skipped:
        by_reason.setdefault(why, []).append(f)
    parts = [
        f"{len(fs)} {why} ({fs[0]}{' ...' if len(fs) > 1 else ''})" for why, fs in by_reason.items()
    ]
    return f"data path {data}: skipped {len(skipped)} of {total} files: {'; '.join(parts)}"


def load_corpus(data: str | None, max_bytes: int, *, notes: list[str] | None = None) -> bytes:
    """The corpus bytes: ``data`` (a file or a directory) or the standard library's source.

    Only regular files are read (a named pipe, a socket or a device is never opened for
    reading); a file that cannot be read is skipped, and ``notes`` (when given) receives one line
    saying how many were skipped and why.

    Raises:
        FileNotFoundError: ``data`` does not exist.
        ValueError: it holds no bytes (naming why, when files were skipped), or it is not a
            regular file or directory, or it cannot be reached (a symlink loop, no permission).
    """
    if data is None:
        files, what = _stdlib_files(), f"the standard library at {sysconfig.get_paths()['stdlib']}"
    else:
        path = Path(data)
        if not os.path.lexists(path):
            raise FileNotFoundError(f"data path {data} does not exist")
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ValueError(f"data path {data} cannot be read: {_os_reason(exc)}") from None
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise ValueError(
                f"data path {data} must be a regular file or a directory, not {_kind(mode)}"
            )
        files, what = _user_files(path), f"data path {data}"
    chunks, total = [], 0
    skipped: list[tuple[Path, str]] = []
    for f in files:
        if total >= max_bytes:
            break
        why = _why_not(f)
        if why is None:
            try:
                blob = _read_regular(f, max_bytes - total)
            except OSError as exc:
                why = _os_reason(exc)
        if why is not None:
            skipped.append((f, why))
            continue
        if blob:
            chunks += [blob, SEPARATOR]
            total += len(blob) + len(SEPARATOR)
    corpus = b"".join(chunks)[:max_bytes]
    if skipped and data is not None:
        line = _skipped_line(data, skipped, len(files))
        if not corpus.strip():
            raise ValueError(f"{line}; nothing left to train on")
        if notes is not None:
            notes.append(line)
    if not corpus.strip():
        raise ValueError(f"{what} is empty: no text to train on")
    return corpus


class WindowedData:
    """Sampling over non-overlapping windows of ``seq_len + 1`` ids of one split, shared by
    bytes (:class:`PackedData`) and token shards (``moesaic.train.tokens.TokenData``): one
    integer of data position (``consumed``) fixes every rank's batch, so a resume is exact and
    the world size may change. A split gives ``num_windows``, :meth:`windows` and, per epoch,
    its order of windows (:meth:`window_of`)."""

    num_windows: int

    def windows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [B, T] int64, of the windows ``idx``."""
        raise NotImplementedError

    def window_of(self, epoch: int, pos: int, seed: int) -> int:
        """The window at position ``pos`` of epoch ``epoch``'s order (keyed by ``seed``)."""
        raise NotImplementedError

    def train_batch(
        self, consumed: int, rank: int, batch_size: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s batch when ``consumed`` samples were used by all ranks before it."""
        idx = []
        for j in range(batch_size):
            epoch, pos = divmod(consumed + rank * batch_size + j, self.num_windows)
            idx.append(self.window_of(epoch, pos, seed))
        return self.windows(torch.tensor(idx))

    def val_batch(
        self, i: int, rank: int, world_size: int, batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The i-th validation batch of ``rank`` (fixed windows, wrapped if the split is small)."""
        start = (i * world_size + rank) * batch_size
        idx = torch.arange(start, start + batch_size) % self.num_windows
        return self.windows(idx)


class PackedData(WindowedData):
    """Non-overlapping windows of ``seq_len + 1`` bytes of one split.

    Args:
        data: the split's bytes.
        seq_len: T.
        name: "train" or "validation" (for messages).
    """

    def __init__(self, data: bytes, seq_len: int, name: str) -> None:
        span = seq_len + 1
        n = (len(data) - 1) // seq_len
        if n < 1:
            raise ValueError(
                f"the {name} split has {len(data)} bytes, fewer than seq_len + 1 ({span}); "
                "give more data, a smaller seq_len or another val_fraction"
            )
        self.seq_len = seq_len
        self.num_windows = n
        self.bytes_per_token = 1.0  # a token is a byte (for bits per byte)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        # Window i is bytes [i*T, i*T + T + 1): consecutive windows share one byte, so every
        # byte but the first is a target exactly once.
        self._windows_NS = buf.unfold(0, span, seq_len)[:n]
        self._perm_epoch: tuple[int, torch.Tensor] | None = None

    def windows(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [B, T] int64, of the windows ``idx``."""
        w_BS = self._windows_NS[idx].long()
        return w_BS[:, :-1], w_BS[:, 1:]

    def window_of(self, epoch: int, pos: int, seed: int) -> int:
        """Epoch ``epoch``'s order: a permutation of the windows, kept for the epoch."""
        if self._perm_epoch is None or self._perm_epoch[0] != epoch:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            self._perm_epoch = (epoch, torch.randperm(self.num_windows, generator=gen))
        return int(self._perm_epoch[1][pos])


def split_corpus(corpus: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    """(train, validation): the last ``val_fraction`` of the bytes is validation."""
    n_val = max(2, int(len(corpus) * val_fraction))
    return corpus[:-n_val], corpus[-n_val:]


def load_splits(
    data: str | None,
    max_bytes: int,
    val_fraction: float,
    seq_len: int,
    *,
    notes: list[str] | None = None,
) -> tuple[PackedData, PackedData]:
    """Load, split and pack the corpus; errors say what is missing (``notes``: see
    :func:`load_corpus`)."""
    train, val = split_corpus(load_corpus(data, max_bytes, notes=notes), val_fraction)
    return PackedData(train, seq_len, "train"), PackedData(val, seq_len, "validation")
