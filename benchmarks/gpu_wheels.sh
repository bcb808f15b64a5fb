#!/usr/bin/env bash
# The wheels gpu_run.sh installs on the device machine (no registry there), fetched here into
# .whl (ignored: add `/.whl/` to .git/info/exclude) at the versions its results were made with;
# pure-Python wheels, so no platform matters. Then: the device call carries .whl.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform any -d "$@"; }
# the layer race (gpu_layer.py: torchtitan 0.3.0's MoE module, which imports on torch 2.11) and
# flowmoe's Sp tuner
get .whl torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 \
  typeguard==4.6.1 torchdata==0.11.0 torch_checkpointing==0.1.1 bayesian-optimization==3.4.0
# the training-step race (gpu_train_step.py): torchtitan 0.2.2, whose trainer runs on torch 2.11
# (0.3.0's imports FSDP names torch 2.11 lacks), and what its package imports that the image lacks
mkdir -p .whl/step
get .whl/step torchtitan==0.2.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls .whl .whl/step
