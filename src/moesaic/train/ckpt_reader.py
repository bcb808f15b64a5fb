"""Reading a DCP checkpoint without running code from it.

``torch.distributed.checkpoint``'s ``FileSystemReader.read_metadata`` reads ``.metadata`` with
a plain ``pickle.load``: a ``.metadata`` whose pickle names ``os.system`` runs its command
before anything can look at it, and a manifest does not help (whoever writes the checkpoint
writes the manifest too). DCP's default load planner also unpickles, with ``weights_only=False``,
every entry the metadata declares as bytes. :class:`SafeReader` closes both:

* ``.metadata`` is read by :class:`MetadataUnpickler`, which admits only the types DCP's
  metadata is made of (``ALLOWED_GLOBALS``, torch dtypes) and refuses any other global, so
  nothing the file names is called unless it is on that list;
* the metadata must then describe tensors only (moesaic never saves anything else), in data
  files named as DCP names them, inside the checkpoint directory;
* the tensors themselves are read by DCP with ``torch.load(weights_only=True)``.

What loading a checkpoint still trusts is written in ``docs/training.md`` (Checkpoints).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from moesaic.train.errors import CheckpointDamaged, CheckpointError, describe

__all__ = ["ALLOWED_GLOBALS", "MetadataUnpickler", "SafeReader", "read_metadata"]

_MD = "torch.distributed.checkpoint.metadata"
# Every global a DCP .metadata of tensors pickles (torch 2.4-2.13), each harmless to call:
# dataclasses of plain fields, torch.Size, a layout looked up by name, an enum, a path.
ALLOWED_GLOBALS = frozenset(
    {
        (_MD, "Metadata"),
        (_MD, "TensorStorageMetadata"),
        (_MD, "BytesStorageMetadata"),  # loaded, then refused by ``_check`` below
        (_MD, "TensorProperties"),
        (_MD, "ChunkStorageMetadata"),
        (_MD, "MetadataIndex"),
        (_MD, "StorageMeta"),
        (_MD, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),  # Python 3.13's home of the class
        ("pathlib._local", "PurePosixPath"),
    }
)
# DCP's FileSystemWriter names data files __<rank>_<n>.distcp.
_DATA_FILE = re.compile(r"__[0-9]+_[0-9]+\.distcp")


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``ALLOWED_GLOBALS`` and torch dtypes; any other global
    (``os.system``, ``builtins.eval``, ...) raises CheckpointError before it is called."""

    def __init__(self, data: bytes, where: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"checkpoint {self._where} is refused: its .metadata names {module}.{name}, which "
            "is not a checkpoint metadata type (loading a checkpoint never runs code from it)"
        )


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint ``path``, read safely and checked (see module docstring).

    Raises:
        CheckpointError: the file is unreadable or damaged ("is corrupt"), or names a type
            outside the metadata's own, or describes anything but tensors in its own data files
            ("is refused").
    """
    try:
        data = (path / ".metadata").read_bytes()
    except OSError as exc:
        raise CheckpointDamaged(
            f"checkpoint {path} is corrupt: cannot read its DCP .metadata ({describe(exc)})"
        ) from None
    try:
        md = MetadataUnpickler(data, path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a damaged pickle: EOF, bad opcodes, wrong arguments
        raise CheckpointDamaged(
            f"checkpoint {path} is corrupt: cannot read its DCP .metadata ({describe(exc)})"
        ) from None
    _check(md, path)
    return md


def _check(md: Any, path: Path) -> None:
    """Refuse metadata that is not a DCP Metadata of tensors in this directory's data files."""
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CheckpointDamaged(
            f"checkpoint {path} is corrupt: its .metadata holds a {type(md).__name__}, not "
            "DCP metadata"
        )
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            # Bytes entries are unpickled by DCP's planner with weights_only=False.
            raise CheckpointError(
                f"checkpoint {path} is refused: entry {key!r} is stored as "
                f"{type(entry).__name__}; a moesaic checkpoint holds tensors only"
            )
    for info in (md.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
            raise CheckpointError(
                f"checkpoint {path} is refused: its .metadata points at data file {name!r}; "
                "data files must be named __<rank>_<n>.distcp inside the checkpoint"
            )


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of its ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: a format moesaic never writes
            raise CheckpointError(f"checkpoint {self.path} is refused: per-rank .metadata")
        md = read_metadata(Path(self.path))
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
