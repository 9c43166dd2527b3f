#!/usr/bin/env bash
# Call 3: the one-launch FP8 MLP as a cooperative grid of resident programs (no ticket): GPU
# tests, the block alone beside the two launches and the ticket schedule, batch 1 end to end.
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
timeout 150 python3 -m pytest -q -x tests/test_one_row_mlp.py -p no:cacheprovider \
    > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
PYTHONPATH=benchmarks:. timeout 150 python3 benchmarks/one_row_mlp_bench.py \
    --out "$OUT/one_row_mlp.json" 2>&1 | tail -3
for pass in 1 2; do
    # the tree before this session (945f596, extracted to .scratch/base): the refactor's check
    KILN_TREE=.scratch/base TAG=base_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    TAG=mlp0_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    KILN_ONE_ROW_MLP=2 TAG=mlp2_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
done
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
