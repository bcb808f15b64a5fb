#!/usr/bin/env bash
# The wheels gpu_run.sh installs on the device machine (no registry there), fetched here into
# .whl (ignored: add `/.whl/` to .git/info/exclude) at the versions its results were made with;
# pure-Python wheels, so no platform matters. Then: the device call carries .whl.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform any -d .whl \
  torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 \
  torchdata==0.11.0 torch_checkpointing==0.1.1 bayesian-optimization==3.4.0
ls .whl
