"""scripts/lockcheck.py: the lock of the test toolchain is read, written and compared by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "test.lock"


def _load():
    spec = importlib.util.spec_from_file_location("lockcheck", ROOT / "scripts" / "lockcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lockcheck = _load()


def test_the_lock_pins_the_toolchain_for_one_python():
    pins, header = lockcheck.read_lock(LOCK)
    for tool in ("pytest", "pytest-timeout", "ruff", "mypy", "hypothesis", "numpy", "pip"):
        assert tool in pins, tool
    assert all(v[0].isdigit() for v in pins.values()), "every entry is name==version"
    assert not lockcheck.UNLOCKED & pins.keys()  # torch and moesaic are never locked
    assert set(header) == {"python", "platform"}


def test_a_package_missing_from_the_lock_is_named():
    """What CI does after removing one line of the lock: the package fails by name."""
    pins, _ = lockcheck.read_lock(LOCK)
    present = dict(pins)
    trimmed = {n: v for n, v in pins.items() if n != "pytest-timeout"}
    problems = lockcheck.compare(trimmed, present)
    assert problems == [f"pytest-timeout {pins['pytest-timeout']} is installed but not locked"]
    assert lockcheck.compare(pins, present) == []


def test_other_versions_and_absent_packages_fail():
    locked = {"ruff": "0.17.6", "mypy": "2.4.1"}
    present = {"ruff": "0.18.0"}
    assert lockcheck.compare(locked, present) == [
        "mypy is locked at 2.4.1 but not installed",
        "ruff is locked at 0.17.6 but 0.18.0 is installed",
    ]


def test_names_are_compared_normalized():
    pins = lockcheck.parse_pins(["Typing_Extensions==4.16.0", "# made: x", "", "pydantic-core==2"])
    assert pins == {"typing-extensions": "4.16.0", "pydantic-core": "2"}


def test_another_python_is_refused_with_both_named():
    here = lockcheck.this_python()
    assert lockcheck.mismatch(here) is None
    other = {**here, "python": "3.9"}
    assert lockcheck.mismatch(other) == f"the lock is for python '3.9', this is '{here['python']}'"


def test_write_then_read_round_trips(tmp_path, monkeypatch):
    monkeypatch.setattr(lockcheck, "installed", lambda: {"b-pkg": "2.0", "a-pkg": "1.0"})
    path = tmp_path / "test.lock"
    lockcheck.write(path)
    pins, header = lockcheck.read_lock(path)
    assert pins == {"a-pkg": "1.0", "b-pkg": "2.0"}
    assert header == lockcheck.this_python()
    assert path.read_text().index("a-pkg") < path.read_text().index("b-pkg")


@pytest.mark.parametrize("mode", [[], ["--matches-python"]])
def test_a_missing_lock_file_is_one_line(tmp_path, capsys, mode):
    assert lockcheck.main([str(tmp_path / "none.lock"), *mode]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none.lock" in err[0]


def test_the_installed_listing_leaves_torch_and_moesaic_out(monkeypatch):
    freeze = "torch==2.13.0+cpu\npytest==9.2.0\nMoesaic==0.1.0\n"

    class Done:
        stdout = freeze

    monkeypatch.setattr(lockcheck.subprocess, "run", lambda *a, **k: Done())
    assert lockcheck.installed() == {"pytest": "9.2.0"}
