"""Training's failure vocabulary: its exception types, one-line descriptions, the root cause.

A leaf (no moesaic import at module level) that checkpoints, the run lock, the loop and the
launcher all import. The worker side, which turns a failure into a log and that line, is
:mod:`moesaic.train.worker`; the launcher picks the rank that failed first for a reason of its own
(:func:`pick_root_cause`) from the records the workers leave under :data:`RECORD_KEY`, and
reports the group's failure in one line (:func:`failure_line`: the local and the emulated launcher).
"""

from __future__ import annotations

from typing import Any

# Key of our record in the elastic error file (next to torch's "message" and "timestamp").
RECORD_KEY = "moesaic"
# Torch's own wording when a gloo/NCCL peer went away: the symptom, not the cause.
_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class CheckpointError(ValueError):
    """A checkpoint is damaged, incompatible, non-finite, or could not be written."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's files are missing, short, unreadable or differ from its manifest (a
    resume may go back to an older, intact one); not one that is refused or incompatible."""


class RunDirError(ValueError):
    """The run directory cannot be used (not a directory, not writable, locked by another run)."""


def first_failure(exc: BaseException) -> tuple[int, BaseException] | None:
    """The lowest rank's underlying error in a DCP ``CheckpointException`` (None if it holds none)."""
    failures = getattr(exc, "failures", None) or {}
    for rank, pair in sorted(failures.items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, BaseException):
            return rank, inner
    return None


def checkpoint_cause(exc: BaseException) -> str:
    """The first underlying error of a torch.distributed.checkpoint ``CheckpointException``."""
    found = first_failure(exc)
    if found is None:
        return type(exc).__name__
    rank, inner = found
    return f"{describe(inner)} (on rank {rank})"


def is_checkpoint_exception(exc: BaseException) -> bool:
    """True for DCP's ``CheckpointException`` (a ``BaseException``, so not caught as Exception)."""
    return type(exc).__name__ == "CheckpointException" and hasattr(exc, "failures")


def describe(exc: BaseException) -> str:
    """One line for ``exc``: its message for the errors a user can act on, else type and message.

    Expected failures (bad config or data, I/O, checkpoints, collectives) are described by their
    message alone; anything else (an ``IndexError``, a ``TypeError``) keeps its type name, since
    the type is then part of the cause.
    """
    from moesaic.comm.collectives import CollectiveError

    if is_checkpoint_exception(exc):
        return f"checkpoint I/O failed: {checkpoint_cause(exc)}"
    if isinstance(exc, OSError):
        text = exc.strerror or str(exc)
        where = exc.filename if exc.filename is not None else None
        return f"{where}: {text}" if where else text
    text = " ".join(str(exc).split())  # one line, whatever the message held
    # moesaic's own exception types (NonFiniteError, RankMismatchError, ...) are deliberate.
    if isinstance(exc, (ValueError, CollectiveError)) or type(exc).__module__.startswith(
        "moesaic."
    ):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_peer_failure(exc: BaseException) -> bool:
    """True when ``exc`` is the echo of another rank's failure (a collective that lost a peer)."""
    from moesaic.comm.collectives import CollectiveError

    if isinstance(exc, CollectiveError):
        return True
    text = str(exc)
    return any(w in text for w in _PEER_WORDS)


def pick_root_cause(failures: dict[int, Any]) -> tuple[int, str | None]:
    """The rank whose failure caused the others and its line (None when it left no record).

    ``failures`` maps global rank to torch elastic's ``ProcessFailure``. A rank's own error
    beats a peer failure; among equals the earliest wins; ranks with no record (killed by the
    agent, or by a signal) come last.
    """

    def key(item: tuple[int, Any]) -> tuple[int, float, int]:
        rank, failure = item
        rec = (getattr(failure, "error_file_data", None) or {}).get(RECORD_KEY)
        if not isinstance(rec, dict):
            return (2, float(getattr(failure, "timestamp", 0) or 0), rank)
        return (1 if rec.get("peer") else 0, float(rec.get("time", 0)), rank)

    rank, failure = min(failures.items(), key=key)
    rec = (getattr(failure, "error_file_data", None) or {}).get(RECORD_KEY)
    return rank, rec.get("line") if isinstance(rec, dict) else None


def failure_line(failures: dict[int, Any], max_restarts: int) -> str:
    """The one line of a failed worker group: the root cause's (``pick_root_cause``), or how
    the rank ended when it left no record; ``failures`` maps rank to a ``ProcessFailure`` (or
    anything with its ``exitcode``, ``signal_name()``, ``error_file_data`` and ``timestamp``)."""
    rank, line = pick_root_cause(failures)
    if line is None:
        failure = failures[rank]
        how = (
            f"was killed by signal {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exited with code {failure.exitcode}"
        )
        line = f"rank {rank} {how} without reporting an error"
    if max_restarts:
        line += f" (the group was restarted {max_restarts} time(s) before)"
    return line
