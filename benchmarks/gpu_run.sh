#!/usr/bin/env bash
# This round's GPU checks (issue 56; issue 53's device runs) in one call of the device machine (a
# fresh image with torch, Triton and transformers, no registry): the peers' wheels travel in .whl
# (torchtitan 0.3.0 and what it imports; bayesian-optimization: flowmoe's Sp tuner), fetched here
# by benchmarks/gpu_wheels.sh.
#   bash benchmarks/gpu_run.sh OUT_DIR COMMIT
# Writes OUT_DIR/{run.log,tests_gpu.log,train_nccl.log,gpu_layer.json,gpu_persistent.json,
# gpu_train_step.json} (what one device call brings back). First the parts that time nothing, side
# by side (tests/gpu in 8 workers; the 50-step hybrid and flowmoe runs on NCCL), then the timed
# benchmarks one at a time, each bounded (its JSON is written as it goes: a bound cut keeps what
# it measured). PART=layer,persistent,... runs some (tests, train, layer, persistent, step);
# STEP_ONLY=moesaic|torchtitan one side of the step race (STEP_MOESAIC: eager,compile); MODULES the layer race's modules.
set -u
OUT=${1:?out dir}; COMMIT=${2:-unknown}
PART=${PART:-tests,train,layer,persistent,step}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && SITE=/tmp/site
fi
export PYTHONPATH=src${SITE:+:$SITE}
STEP_PATH=$PYTHONPATH  # gpu_train_step: torchtitan 0.2.2 first (.whl/step, gpu_wheels.sh)
if ls .whl/step/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site_step .whl/step/*.whl && STEP_PATH=src:/tmp/site_step${SITE:+:$SITE}
fi
want() { [[ ",$PART," == *",$1,"* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
t0=$SECONDS

train_nccl() {  # 50 steps of examples/train_tiny.toml at EP 1 on NCCL, every collective run
  for run in "hybrid:--strategy hybrid" "flowmoe:--schedule flowmoe"; do
    name=${run%%:*}
    echo "== $name"
    # shellcheck disable=SC2086
    MOESAIC_NO_SHORTCUTS=1 timeout 150 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 1 -m moesaic.train --config examples/train_tiny.toml --ep 1 --steps 50 \
      --backend nccl ${run#*:} --run-dir "/tmp/train_$name" --no-progress --eval-every 25 \
      --ckpt-every 25 --warmup-steps 5 2>&1 | tail -12
    python3 - "/tmp/train_$name/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(s) for s in open(sys.argv[1])]
loss = [r["loss"] for r in rows if r["kind"] == "train"]
val = [r["val_loss"] for r in rows if r["kind"] == "val"]
print(f"steps {len(loss)}: loss {loss[0]:.4f} -> {loss[-1]:.4f}, val {val}, falls {loss[-1] < loss[0] - 0.5}")
EOF
  done
}

# Each test named as it ends (-v: a run cut short still says which passed and failed), a test
# that hangs failed with its stack after 60 s (pytest-timeout), the failures' tracebacks short.
# The tests run in a process group of their own (setsid), killed whole after they end or time
# out: `timeout` stops pytest only, and at 14d9e4f its xdist workers and their spawned worlds
# ran on into the timed layer race (its host times doubled).
pids=()
if want tests; then
  setsid bash -c 'timeout 150 python3 -m pytest -v -rfE --tb=short --timeout 60 -n 8 \
     -p no:cacheprovider tests/gpu >"$1/tests_gpu.log" 2>&1
   echo "tests/gpu rc $?" >>"$1/tests_gpu.log"' _ "$OUT" &
  tests_pid=$!
  pids+=($tests_pid)
fi
if want train; then
  train_nccl >"$OUT/train_nccl.log" 2>&1 &
  pids+=($!)
fi
# Never a bare `wait`: bash (5.1+) waits for the `tee` process substitution above too, which
# ends only with this script (the first run of this script hung there until its bound).
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
if want tests; then
  kill -9 -- "-$tests_pid" 2>/dev/null  # whatever of the tests' group is left
  tail -3 "$OUT/tests_gpu.log"
fi
want train && grep -E "^==|^steps" "$OUT/train_nccl.log"
echo "untimed parts ${SECONDS}s"
if want layer; then
  timeout 150 python3 benchmarks/gpu_layer.py --out "$OUT/gpu_layer.json" \
    --profile benchmarks/results/sim_profile_h200.json --passes 5 --iters 10 --stream 10 \
    --modules "${MODULES:-dropless,dropless+compile,torchtitan,torchtitan+compile}" \
    --commit "$COMMIT" \
    || echo "gpu_layer rc $?"
  echo "gpu_layer ${SECONDS}s"
fi
if want persistent; then
  timeout 75 python3 benchmarks/gpu_persistent.py --out "$OUT/gpu_persistent.json" \
    || echo "gpu_persistent rc $?"
  echo "gpu_persistent ${SECONDS}s"
fi
if want step; then
  PYTHONPATH=$STEP_PATH timeout 220 python3 benchmarks/gpu_train_step.py --out "$OUT/gpu_train_step.json" \
    --steps 8 --warmup 2 --profile-steps 2 --moesaic "${STEP_MOESAIC:-eager,compile}" \
    --commit "$COMMIT" --only "${STEP_ONLY:-}" \
    || echo "gpu_train_step rc $?"
  echo "gpu_train_step ${SECONDS}s"
fi
echo "done in $((SECONDS - t0)) s"
