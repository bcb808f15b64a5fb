"""Reading the files the simulator's commands are given (``simulate``, ``calibrate``,
``plan``): errors that name the option and the file. Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["load_option"]


def load_option(option: str, path: str, load: Callable[[str], Any]) -> Any:
    """``load(path)`` with its errors naming ``--option`` (and the file)."""
    try:
        return load(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--{option}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"--{option} {path}: {exc}") from None
