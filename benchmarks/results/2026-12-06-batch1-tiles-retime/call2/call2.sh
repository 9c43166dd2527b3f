#!/usr/bin/env bash
# Call 2: call 1's batch-1 A/B again (HEAD against 1899ce9 in .scratch/base, two passes
# alternated) on whichever card the H200 kind gives: on an H200 it is the figure the issue's
# table needs; on an H100 a second machine's reading.
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
for pass in 1 2; do
    KILN_TREE=.scratch/base TAG=base_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    TAG=head_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
done
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
