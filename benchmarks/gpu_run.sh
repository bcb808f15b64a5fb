#!/usr/bin/env bash
# Everything issue 27 measures on one GPU, in one call of the device machine (a fresh image with
# torch, no registry): the peers' wheels travel in .whl (bayesian-optimization too: the image
# lacks it, and tests/gpu's nccl-flowmoe training tunes Sp with it), the baseline library
# (optional) in .base/src (docs/performance.md, "On a GPU").
#   bash benchmarks/gpu_run.sh OUT_DIR COMMIT [gpu_layer args...]
# Writes OUT_DIR/{run.log,sim_profile.json,gpu_layer.json,gpu_layer_base.json,traces.tar.gz,
# gpu_check.json,tests_gpu.log,train.log} (8 files: what one device call brings back).
# SKIP_CHECK=1: the measurements alone (no tests/gpu, correctness check or training run).
set -u
OUT=${1:?out dir}; COMMIT=${2:-unknown}; shift 2 || true
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && SITE=/tmp/site
fi
export PYTHONPATH=src${SITE:+:$SITE}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
t0=$SECONDS
timeout 60 python3 -m moesaic calibrate --out "$OUT/sim_profile.json" || echo "calibrate rc $?"
echo "calibrate ${SECONDS}s"
timeout 200 python3 benchmarks/gpu_layer.py --out "$OUT/gpu_layer.json" --traces /tmp/traces \
  --profile "$OUT/sim_profile.json" --commit "$COMMIT" "$@" || echo "gpu_layer rc $?"
echo "gpu_layer ${SECONDS}s"
tar czf "$OUT/traces.tar.gz" -C /tmp traces 2>/dev/null
if [ -d .base/src ]; then  # the library before this change, same script, same machine
  PYTHONPATH=.base/src${SITE:+:$SITE} timeout 60 python3 benchmarks/gpu_layer.py \
    --out "$OUT/gpu_layer_base.json" --modules dropless --commit "base" || echo "base rc $?"
  echo "baseline ${SECONDS}s"
fi
[ -n "${SKIP_CHECK:-}" ] && { echo "done in $((SECONDS - t0)) s (SKIP_CHECK: no tests)"; exit 0; }
timeout 200 python3 benchmarks/gpu_check.py --device cuda --out "$OUT/gpu_check.json" \
  --skip speed,sim --train-steps 40 --train-log "$OUT/train.log" --tests-timeout-s 120 \
  --tests-workers 8 --tests-log "$OUT/tests_gpu.log" --commit "$COMMIT" || echo "gpu_check rc $?"
echo "done in $((SECONDS - t0)) s"
