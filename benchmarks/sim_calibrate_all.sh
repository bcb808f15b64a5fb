#!/usr/bin/env bash
# Calibrates every cluster the simulator's validation uses (benchmarks/sim_validate.py), three
# times each, into benchmarks/results/sim_profile_<cluster>{,_cal2,_cal3}.json. Needs root, ip
# and tc (emulated clusters); ~40-60 s per calibration. Usage: bash benchmarks/sim_calibrate_all.sh
# [suffix ...] (default: "" _cal2 _cal3); each calibration takes /tmp/moesaic_timing.lock.
# OUT=DIR writes the profiles there instead (then copy them into benchmarks/results at once).
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
OUT=${OUT:-$R}
mkdir -p "$OUT"
clusters=(
  "flowmoe_2rank=examples/clusters/flowmoe_2rank.toml"
  "hybridep_2dc=examples/clusters/hybridep_2dc.toml"
  "hybridep_2dc2=examples/clusters/hybridep_2dc2.toml"
  "hybridep_4dc=examples/clusters/hybridep_4dc.toml"
  "taskflow_0.5gbps=$R/sim_cluster_taskflow_0.5gbps.toml"
  "taskflow_1gbps=$R/sim_cluster_taskflow_1gbps.toml"
  "taskflow_2gbps=$R/sim_cluster_taskflow_2gbps.toml"
)
suffixes=("$@")
[ ${#suffixes[@]} -eq 0 ] && suffixes=("" _cal2 _cal3)
for suffix in "${suffixes[@]}"; do
  for entry in "${clusters[@]}"; do
    name=${entry%%=*}
    file=${entry#*=}
    echo "$(date -u +%H:%M:%S) calibrating $name$suffix"
    flock /tmp/moesaic_timing.lock python -m moesaic calibrate --cluster "$file" \
      --out "$OUT/sim_profile_$name$suffix.json"
  done
done
