#!/usr/bin/env bash
# Call 3: o_proj merging decode attention's partitions: GPU tests, the microbenchmark, batch 1
# A/B (the tree before this session, this tree with the reduce, this tree merging), two passes.
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
PYTHONPATH=benchmarks:. timeout 120 python3 benchmarks/merge_o_proj_bench.py \
    --out "$OUT/merge.json" 2>&1 | grep -v Warn
for pass in 1 2; do
    KILN_TREE=.scratch/base TAG=base_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    KILN_DECODE_MERGE_IN_PROJECTION=0 TAG=merge0_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    TAG=merge1_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    KILN_DECODE_MERGE_PER_HEAD=1 TAG=merge1h_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
done
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
bash benchmarks/h200_run.sh prof1-s8kv8h8 2>&1 | grep "exit"
head -12 "$OUT"/profile_decode_b1*.txt
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_split_k_linear.py \
    tests/test_triton_kernels.py -k "merge or idle_splits or graph_grid or decode_attention_many" \
    > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
