#!/usr/bin/env bash
# The whole suite, in a virtual environment of its own: made outside the checkout from
# requirements/test.lock, checked against it, used for the linter, the format check, the type
# checker and pytest, and removed at the end, so a package left on the machine hides nothing.
# .ci/run runs this; PYTHON picks the interpreter the environment is made from.
set -euo pipefail
cd "$(dirname "$0")/.."
base="${PYTHON:-python}"
lock=requirements/test.lock
"$base" scripts/lockcheck.py --matches-python "$lock"
work="$(mktemp -d "${TMPDIR:-/tmp}/moesaic-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
start=$SECONDS
"$base" -m venv "$work/venv"
export VIRTUAL_ENV="$work/venv" PATH="$work/venv/bin:$PATH"  # subprocesses' python is this one
python -m pip install --quiet --disable-pip-version-check -c "$lock" pip setuptools
PYTHON=python bash scripts/setup.sh test
python -m pip check
python scripts/lockcheck.py "$lock"
set_up=$((SECONDS - start))
echo "check.sh: environment $VIRTUAL_ENV made in ${set_up} s:" \
  "$(python -c 'import platform, pytest, torch; print(f"Python {platform.python_version()}, torch {torch.__version__}, pytest {pytest.__version__}")')"
start=$SECONDS
python -m ruff check .
python -m ruff format --check .
python -m mypy
echo "check.sh: set-up ${set_up} s, ruff + mypy $((SECONDS - start)) s; pytest's own line gives its time"
# two pytest-xdist workers: on 2 cores the suite takes ~8 minutes this way against ~13 serially
# (many tests wait on processes they start); tests keep to paths and ports of their own
python -m pytest -q -n 2
