#!/usr/bin/env bash
# Call 4: static fp8 batch 1 both ways on an H200 (the issue-13 row on its own card), twice,
# alternated; on any other card it stops at once (the H100 A/B is calls 1-2).
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
[[ $GPU == *H200* ]] || exit 0
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
for pass in 1 2; do
    KILN_SMALL_BATCH_SWAP_AB=0 TAG=swap0_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    TAG=swap1_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
done
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
