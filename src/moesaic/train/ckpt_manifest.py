"""A checkpoint's manifest.json: the size and sha256 of every file, made and checked by shares.

Hashing a large checkpoint on a network file system takes minutes, longer than a collective may
wait (NCCL's watchdog aborts a rank that waits past ``--timeout-s``). So no rank hashes what
another wrote while the others wait:

* saving, each rank hashes the data files it wrote itself (``__<rank>_*.distcp``) into a part
  (``manifest.rank_<rank>.json``), outside any collective; rank 0 then hashes only the small
  files (``.metadata``, ``meta.json``) and merges the parts into manifest.json;
* checking, every rank compares every file's size (a ``stat``) and hashes its share of the files
  (file ``i`` by rank ``i mod world``); the ranks then agree on the first damaged file
  (:func:`damaged_file_index` and one all-reduce in :mod:`moesaic.train.checkpoint`).

Torch-free: plain files and hashlib.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from moesaic.train.errors import CheckpointDamaged, CheckpointError, describe

__all__ = [
    "MANIFEST",
    "damage_message",
    "damaged_file_index",
    "fsync_dir",
    "manifest_items",
    "merge_manifest",
    "verify_manifest",
    "write_atomic",
    "write_part",
]

MANIFEST = "manifest.json"


def _part_name(rank: int) -> str:
    return f"manifest.rank_{rank}.json"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and a rename."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    # hashlib.file_digest is Python 3.11+; we support 3.10.
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def write_part(ckpt: Path, rank: int) -> None:
    """This rank's part of the manifest: the data files it wrote (a rank with none writes an
    empty part, so rank 0 can tell "nothing written" from "not finished")."""
    files = {p.name: _entry(p) for p in sorted(ckpt.glob(f"__{rank}_*.distcp")) if p.is_file()}
    write_atomic(ckpt / _part_name(rank), json.dumps(files))


def merge_manifest(ckpt: Path, world_size: int) -> None:
    """Rank 0, after every rank wrote its part: manifest.json of every file of ``ckpt``.

    A file no part lists (none is expected) is hashed here, so the manifest is never partial.
    """
    files: dict[str, dict] = {}
    parts = [ckpt / _part_name(r) for r in range(world_size)]
    for part in parts:
        try:
            files.update(json.loads(part.read_text()))
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"checkpoint {ckpt} cannot be finished: part {part.name} of its manifest is "
                f"unreadable ({describe(exc)})"
            ) from None
    for part in parts:
        part.unlink()
    for p in sorted(ckpt.iterdir()):
        if p.is_file() and p.name != MANIFEST and p.name not in files:
            files[p.name] = _entry(p)
    text = json.dumps({"algorithm": "sha256", "files": dict(sorted(files.items()))}, indent=1)
    write_atomic(ckpt / MANIFEST, text)


def manifest_items(ckpt: Path) -> list[tuple[str, int, str]]:
    """``(name, size, sha256)`` of every file manifest.json lists, sorted by name."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        items = [(str(n), int(e["size"]), str(e["sha256"])) for n, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointDamaged(
            f"checkpoint {ckpt} is corrupt: cannot read {MANIFEST} ({describe(exc)})"
        ) from None
    for name, _, _ in items:
        if Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointDamaged(
                f"checkpoint {ckpt} is corrupt: {MANIFEST} lists {name!r}, which is not a "
                "file name inside the checkpoint"
            )
    return sorted(items)


def damaged_file_index(ckpt: Path, rank: int = 0, world_size: int = 1) -> int | None:
    """The index (in :func:`manifest_items`) of the first damaged file this rank finds, or None.

    Every file's size is checked; only this rank's share (index mod ``world_size``) is hashed.
    """
    for i, (name, size, digest) in enumerate(manifest_items(ckpt)):
        f = ckpt / name
        if not f.is_file() or f.stat().st_size != size:
            return i
        if i % world_size == rank and _sha256(f) != digest:
            return i
    return None


def damage_message(ckpt: Path, index: int) -> str:
    """The one line for file ``index`` of the manifest, found damaged (the same on every rank:
    a missing file or a wrong size every rank sees; anything else is a sha256 mismatch)."""
    name, size, _ = manifest_items(ckpt)[index]
    f = ckpt / name
    if not f.is_file():
        return f"checkpoint {ckpt} is corrupt: file {name} is missing"
    if f.stat().st_size != size:
        return (
            f"checkpoint {ckpt} is corrupt: file {name} has {f.stat().st_size} bytes, "
            f"{MANIFEST} says {size}"
        )
    return (
        f"checkpoint {ckpt} is corrupt: file {name} does not match its sha256 in {MANIFEST} "
        "(damaged after it was written)"
    )


def verify_manifest(ckpt: Path) -> None:
    """Raise CheckpointError unless every file listed in manifest.json is intact (one process
    hashing everything: ``generate``, the launcher)."""
    index = damaged_file_index(ckpt)
    if index is not None:
        raise CheckpointDamaged(damage_message(ckpt, index))
