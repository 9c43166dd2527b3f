#!/usr/bin/env bash
# Call 1: where batch 1's kernels lose their time, on whatever card comes; on an H200 also the
# swapped dot's A/B (2026-12-05-h100-small-batch-swap-ab/call4 on its own card).
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
if [[ $GPU == *H200* ]]; then
    for pass in 1 2; do
        KILN_SMALL_BATCH_SWAP_AB=0 TAG=swap0_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
        TAG=swap1_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    done
    python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
fi
# the kernels of a batch-1 step (static fp8, float8 KV and LM head), their us a call
bash benchmarks/h200_run.sh prof1-s8kv8h8 2>&1 | grep "exit"
head -30 "$OUT"/profile_decode_b1*.txt
# Nsight Compute: the one-row projections, then batch-1 decode attention and its reduce
STALLS="regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio"
if command -v ncu >/dev/null; then
    PYTHONPATH=.:benchmarks timeout 200 ncu --profile-from-start off --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section LaunchStats --metrics "$STALLS" \
        python3 benchmarks/ncu_one_row.py qkv,o_proj,gate_up,down > "$OUT/ncu_one_row.txt" 2>&1
    tail -3 "$OUT/ncu_one_row.txt"
    (cd benchmarks && PYTHONPATH=.. timeout 120 ncu --kernel-name regex:_decode --launch-skip 4 \
        --launch-count 2 --section SpeedOfLight --section WarpStateStats --section LaunchStats \
        --metrics "$STALLS" python3 ncu_decode_attention.py 1 1024) > "$OUT/ncu_decode_b1.txt" 2>&1
    tail -3 "$OUT/ncu_decode_b1.txt"
else
    echo "no ncu"
fi
