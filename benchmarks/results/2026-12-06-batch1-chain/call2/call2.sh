#!/usr/bin/env bash
# Call 2: where batch 1's kernels lose their time: the step's profile and Nsight Compute on the
# one-row projections and on batch-1 decode attention with its reduce.
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
bash benchmarks/h200_run.sh prof1-s8kv8h8 2>&1 | grep "exit"
head -24 "$OUT"/profile_decode_b1*.txt
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
