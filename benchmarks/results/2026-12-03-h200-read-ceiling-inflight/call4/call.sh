#!/usr/bin/env bash
# Call 4: 1000/1000 at 3000 requests with 1000 in flight against 768, this tree.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -1
cp benchmarks/results/2026-12-03-h200-read-ceiling-inflight/call4/expected.md $R/
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback|memory plan" ; }
DMON=1 run benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8
DMON=1 run benchmarks/h200_run.sh tput1000-3000-16k-s8kv8
cd $OUT && tar czf r.tgz r && rm -rf r
