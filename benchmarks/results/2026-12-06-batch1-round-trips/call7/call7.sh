#!/usr/bin/env bash
# Call 7: batch 1 with the norm-fused kernels' first pass in one 4096-wide step (gate_up and qkv,
# KILN_SMALL_BATCH_TILES) against the table's 1024 / 2048, two passes, one machine.
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
D=benchmarks/results/2026-12-06-batch1-round-trips/call7
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
for pass in 1 2; do
    TAG=table_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    KILN_SMALL_BATCH_TILES=$D/stats4096.json TAG=stats4096_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
done
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
