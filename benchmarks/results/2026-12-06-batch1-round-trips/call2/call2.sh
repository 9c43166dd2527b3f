#!/usr/bin/env bash
# Call 2: batch 1 A/B, pass 2 (same warm machine as call 1).
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
KILN_TREE=.scratch/base TAG=base_2 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
TAG=new_2 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
KILN_SMALL_BATCH_PREFETCH_STEPS=2 TAG=pf2_2 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
