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
compiling="" typing=""
trap 'for job in $compiling $typing; do kill "$job" 2>/dev/null || true; done; rm -rf "$work"' EXIT
start=$SECONDS
"$base" -m venv "$work/venv"
export VIRTUAL_ENV="$work/venv" PATH="$work/venv/bin:$PATH"  # subprocesses' python is this one
python -m pip install --quiet --disable-pip-version-check -c "$lock" pip setuptools
# pip compiles the packages' bytecode one file at a time (torch alone ~35 s); here it is compiled
# by compileall on both cores beside the linters instead, and pytest waits for it (its workers
# run python -B, so nothing left uncompiled may be compiled again in every process)
PIP_COMPILE=false PYTHON=python bash scripts/setup.sh test  # pip install --no-compile
python -m pip check
python scripts/lockcheck.py "$lock"
site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
python -m compileall -q -j 0 "$site" >"$work/compileall.log" 2>&1 &
compiling=$!
set_up=$((SECONDS - start))
echo "check.sh: environment $VIRTUAL_ENV made in ${set_up} s:" \
  "$(python -c 'import platform, pytest, torch; print(f"Python {platform.python_version()}, torch {torch.__version__}, pytest {pytest.__version__}")')"
start=$SECONDS
python -m ruff check .
python -m ruff format --check .
# The type check (~45 s of one core) runs beside the suite at the lowest priority: it takes the
# cycles the tests leave idle while they wait on processes they start, and yields to them
# otherwise; its verdict is read after the suite.
nice -n 19 python -m mypy >"$work/mypy.log" 2>&1 &
typing=$!
wait "$compiling" || true  # a package's unparsable file (pip skips it too) is not this check's
compiling=""
echo "check.sh: set-up ${set_up} s, ruff (and the bytecode) $((SECONDS - start)) s;" \
  "pytest's own line gives its time, mypy's follows it"
# two pytest-xdist workers: on 2 cores the suite takes ~8 minutes this way against ~13 serially
# (many tests wait on processes they start); three were slower (8.3 against 7.5 minutes on one
# tree); tests keep to paths and ports of their own
suite=0
python -m pytest -q -n 2 || suite=$?
typed=0
wait "$typing" || typed=$?
typing=""
cat "$work/mypy.log"
if ((suite || typed)); then
  echo "check.sh: failed (pytest exit ${suite}, mypy exit ${typed})" >&2
  exit 1
fi
