#!/usr/bin/env bash
# 2048/128 (3000 requests, 16384-token steps), main against the exact reciprocal, after a 128/128
# warm-up process of each tree.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
KILN_TREE=.scratch/base TAG=warmbase run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=. TAG=warmexact run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=.scratch/base TAG=base run benchmarks/h200_run.sh tput2048-16k-w8kv8
KILN_TREE=. TAG=exact run benchmarks/h200_run.sh tput2048-16k-w8kv8
