"""Validators shared by every config: one place for "an int >= 1", "a finite number in [a, b]".

Torch-free (the cluster and taskflow CLIs use them without importing torch). Each raises
``ValueError`` naming the field and the rule, e.g. ``num_experts (6) must be >= 8``; callers that
need another exception type (a plan file's format error) catch and re-raise.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an int to Python, never a size to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(
    name: str, value: object, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` is an int within ``[minimum, maximum]`` (either bound optional); returns it."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    assert isinstance(value, int)  # for the type checker; is_int said so
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} ({value}) must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} ({value}) must be <= {maximum}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """``value`` is an int > 0; returns it."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    assert isinstance(value, int)
    if value <= 0:
        raise ValueError(f"{name} ({value}) must be > 0")
    return value


def check_number(
    name: str,
    value: object,
    lo: float = -math.inf,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
) -> float:
    """``value`` is a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); returns it."""
    if not is_number(value):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} ({value!r})")
    assert isinstance(value, (int, float))
    below = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or below or value > hi:
        if lo_open and hi == math.inf:
            rule = f"a finite number > {lo:g}"
        elif hi == math.inf:
            rule = f"a finite number >= {lo:g}"
        else:
            rule = f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ValueError(f"{name} ({value}) must be {rule}")
    return float(value)


def check_non_negative(name: str, value: object) -> float:
    """``value`` is a finite number >= 0; returns it."""
    return check_number(name, value, 0.0)


def check_positive(name: str, value: object) -> float:
    """``value`` is a finite number > 0; returns it."""
    return check_number(name, value, 0.0, lo_open=True)


def check_one_of(name: str, value: object, allowed: Iterable[str]) -> str:
    """``value`` is one of ``allowed``; returns it."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} ({value!r}) must be one of {', '.join(map(repr, allowed))}")
    assert isinstance(value, str)
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` is a bool (not 0/1); returns it."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return value


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """The parsed TOML file at ``path``; errors name ``what`` it is ("cluster file", ...).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is not valid TOML.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a directory; name a TOML file")
    if not p.is_file():
        raise FileNotFoundError(f"{what} {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{what} {str(p)!r} is not text (TOML is UTF-8; byte {exc.start} is not)"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {str(p)!r} is not valid TOML: {exc}") from exc


def check_output_file(name: str, path: str | Path) -> Path:
    """Before any work starts: ``path`` can be written as a file. Missing parent directories
    are created (the rule of every moesaic output option); an existing directory, a parent that
    is a file, and a directory this process cannot write in (read-only, no permission, a full
    or read-only file system: a real file is created and removed there) are refused.

    Args:
        name: the option, for the message (``--trace``, ``--out``).
        path: the file to be written later.

    Returns:
        The path.

    Raises:
        ValueError: naming the option, the path and the reason.
    """
    import errno
    import os
    import tempfile

    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{name} ({path}) is a directory; name a file to write")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{name} ({path}): {parent} is not a directory")
            break
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".probe"):
            pass
        if out.exists() and not os.access(out, os.W_OK):
            raise PermissionError(errno.EACCES, "Permission denied", str(out))
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ValueError(f"{name} ({path}) cannot be written: {why}") from None
    return out
