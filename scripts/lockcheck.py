"""The test toolchain's lock (requirements/test.lock): write it, and check an environment against it.

    python scripts/lockcheck.py requirements/test.lock          # this environment == the lock?
    python scripts/lockcheck.py --write requirements/test.lock  # record this environment
    python scripts/lockcheck.py --matches-python requirements/test.lock

The lock is a pip constraints file: one ``name==version`` a line for every package of the
environment ``pip freeze --all`` shows (pip and setuptools included), torch and moesaic aside (a
user's torch is kept; moesaic is the checkout). Its header names the Python and platform it was
resolved for, since exact versions are only valid there. The check fails, a line per package, on a
package installed but not locked, one locked but not installed, and one at another version.
Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import subprocess
import sys
from pathlib import Path

# Installed but never locked: the user's torch is kept, and moesaic is the checkout itself.
UNLOCKED = frozenset({"torch", "moesaic"})


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def this_python() -> dict[str, str]:
    """The header keys a lock records and an environment must match."""
    major, minor = sys.version_info[:2]
    return {
        "python": f"{major}.{minor}",
        "platform": f"{sys.platform} {platform.machine()}",
    }


def parse_pins(lines: list[str]) -> dict[str, str]:
    """``name==version`` lines (comments and blanks skipped) -> {normalized name: version}."""
    pins: dict[str, str] = {}
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            # A direct reference (name @ url) or anything else pip freeze may print.
            name, version = line.split(" @ ", 1)[0], line
        pins[normalize(name.strip())] = version.strip()
    return pins


def read_lock(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(pins, header) of a lock file; the header holds its ``# key: value`` lines."""
    lines = path.read_text().splitlines()
    header = {}
    for line in lines:
        m = re.match(r"#\s*(python|platform):\s*(.+?)\s*$", line)
        if m:
            header[m.group(1)] = m.group(2)
    return parse_pins(lines), header


def installed() -> dict[str, str]:
    """This environment's packages as ``pip freeze --all`` shows them, less UNLOCKED."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {n: v for n, v in parse_pins(out.splitlines()).items() if n not in UNLOCKED}


def compare(locked: dict[str, str], present: dict[str, str]) -> list[str]:
    """One line per difference between the lock and the environment; empty when they agree."""
    problems = []
    for name in sorted(present.keys() - locked.keys()):
        problems.append(f"{name} {present[name]} is installed but not locked")
    for name in sorted(locked.keys() - present.keys()):
        problems.append(f"{name} is locked at {locked[name]} but not installed")
    for name in sorted(locked.keys() & present.keys()):
        if locked[name] != present[name]:
            problems.append(f"{name} is locked at {locked[name]} but {present[name]} is installed")
    return problems


def mismatch(header: dict[str, str]) -> str | None:
    """Why this Python cannot use a lock with this header, or None when it can."""
    here = this_python()
    for key, value in here.items():
        if header.get(key) != value:
            return f"the lock is for {key} {header.get(key)!r}, this is {value!r}"
    return None


def write(path: Path) -> None:
    """Record this environment as the lock, atomically."""
    here = this_python()
    body = [f"{n}=={v}" for n, v in sorted(installed().items())]
    text = "\n".join(
        [
            "# moesaic's test toolchain at exact versions: every package `scripts/setup.sh test`",
            "# installs besides torch and moesaic. Applied as pip constraints; refreshed on purpose",
            "# with `bash scripts/lock.sh` (CONTRIBUTING.md), never by hand.",
            f"# made: {datetime.date.today().isoformat()}",
            f"# python: {here['python']}",
            f"# platform: {here['platform']}",
            *body,
            "",
        ]
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lock", type=Path)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="record this environment as the lock")
    mode.add_argument(
        "--matches-python", action="store_true", help="exit 1 unless the lock is for this Python"
    )
    args = ap.parse_args(argv)
    if args.write:
        write(args.lock)
        return 0
    if not args.lock.is_file():
        print(f"lockcheck: {args.lock}: no such lock file", file=sys.stderr)
        return 1
    locked, header = read_lock(args.lock)
    why = mismatch(header)
    if args.matches_python:
        if why:
            print(f"lockcheck: {args.lock}: {why}", file=sys.stderr)
        return 1 if why else 0
    problems = ([why] if why else []) + compare(locked, installed())
    for line in problems:
        print(f"lockcheck: {args.lock}: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"lockcheck: {len(locked)} packages, each installed at its locked version")
    return 0


if __name__ == "__main__":
    sys.exit(main())
