#!/usr/bin/env bash
# Call 5: the landed change (epilogue loads hoisted, the reduce without seq_len) on the GPU: the
# kernel tests at real shapes, then batch 1 against the tree before this session, two passes.
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
for pass in 1 2; do
    KILN_TREE=.scratch/base TAG=base_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    TAG=new_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
done
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_split_k_linear.py tests/test_fp8_linear.py -k "not smollm2" \
    > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
