#!/usr/bin/env bash
# Install moesaic (editable) with the optional extras named in $1 (e.g. "test" or "bench").
# torch: a torch the user already has is kept (any build >= 2.4). Only when none is installed do we
# install torch==2.13.0, which on the CPU-only project machines resolves to a local CPU wheel; an
# unpinned torch would pull several GB of CUDA packages there.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-bench}"
py="${PYTHON:-python}"
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  "$py" -m pip install --quiet "torch==2.13.0"
fi
"$py" -m pip install --quiet -e ".[${extras}]"
