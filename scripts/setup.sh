#!/usr/bin/env bash
# Install moesaic (editable) with the optional extras named in $1 (e.g. "test" or "bench").
# torch: a torch the user already has is kept (any build >= 2.4). Only when none is installed do we
# install torch==2.13.0, which on the CPU-only project machines resolves to a local CPU wheel; an
# unpinned torch would pull several GB of CUDA packages there.
# "test": everything else comes at the exact versions of requirements/test.lock (made by
# scripts/lock.sh; CONTRIBUTING.md), applied as pip constraints, the build backend included. The
# library's own dependencies stay floors (pyproject.toml) for every other set of extras.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-bench}"
py="${PYTHON:-python}"
lock="${MOESAIC_LOCK-requirements/test.lock}"  # empty: unlocked (scripts/lock.sh refreshing it)
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  "$py" -m pip install --quiet "torch==2.13.0"
fi
constraint=""
if [[ ",${extras}," == *",test,"* && -n "$lock" ]]; then
  if "$py" scripts/lockcheck.py --matches-python "$lock"; then
    constraint="$lock"
  else
    echo "setup.sh: installing the test toolchain at its floors, unlocked" >&2
  fi
fi
if [[ -n "$constraint" ]]; then
  # PIP_CONSTRAINT (not -c) so the isolated build of moesaic gets the locked setuptools as well.
  PIP_CONSTRAINT="$constraint" "$py" -m pip install --quiet -e ".[${extras}]"
else
  "$py" -m pip install --quiet -e ".[${extras}]"
fi
