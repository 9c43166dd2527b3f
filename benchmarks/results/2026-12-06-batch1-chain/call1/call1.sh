#!/usr/bin/env bash
# Call 1: the one-launch FP8 MLP (kernels.triton.one_row_mlp): GPU tests, the block alone, and
# batch 1 end to end against the two launches (alternated, twice); on an H200 also the swapped
# dot's A/B (2026-12-05-h100-small-batch-swap-ab/call4 on its own card).
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 240 python3 -m pytest -q -x tests/test_one_row_mlp.py tests/test_split_k_linear.py \
    tests/test_fp8_linear.py -k "not smollm2" -p no:cacheprovider > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
PYTHONPATH=benchmarks:. timeout 120 python3 benchmarks/one_row_mlp_bench.py \
    --out "$OUT/one_row_mlp.json" 2>&1 | tail -3
for pass in 1 2; do
    TAG=mlp0_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    KILN_ONE_ROW_MLP=1 TAG=mlp1_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
done
if [[ $GPU == *H200* ]]; then
    for pass in 1 2; do
        KILN_SMALL_BATCH_SWAP_AB=0 TAG=swap0_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    done
fi
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
