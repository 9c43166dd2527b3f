#!/usr/bin/env bash
# Call 4, on call 3's warm H200: the swapped float8 dot's A/B at batch 1, twice, alternated.
export NO_HF=1
for p in 1 2; do
    KILN_SMALL_BATCH_SWAP_AB=0 TAG=swap0_$p bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep exit
    TAG=swap1_$p bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep exit
done
python3 benchmarks/bench_summary.py $OUT/lat1k*.json
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
