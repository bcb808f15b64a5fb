#!/usr/bin/env bash
# Refresh requirements/test.lock on purpose (CONTRIBUTING.md): resolve the test toolchain afresh
# from pyproject.toml's floors in a new virtual environment and record every installed package at
# its exact version, torch and moesaic aside. Run it with the Python the lock is for
# (PYTHON=python3.11 bash scripts/lock.sh), then the whole suite: bash scripts/check.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
base="${PYTHON:-python}"
work="$(mktemp -d "${TMPDIR:-/tmp}/moesaic-lock.XXXXXX")"
trap 'rm -rf "$work"' EXIT
"$base" -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install --quiet --upgrade pip setuptools
PYTHON="$py" MOESAIC_LOCK="" bash scripts/setup.sh test
"$py" scripts/lockcheck.py --write requirements/test.lock
echo "lock.sh: wrote requirements/test.lock ($(grep -c '==' requirements/test.lock) packages)"
