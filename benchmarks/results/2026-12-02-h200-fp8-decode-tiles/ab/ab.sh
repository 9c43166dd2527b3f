#!/usr/bin/env bash
# Same-run A/B: this tree (one-warp float8 decode tiles) against 6143508 (.scratch/trees/base)
python3 -m pip install -q --no-deps --no-index shared/wheels/*.whl 2>&1 | tail -2
run() { KILN_TREE=$1 TAG=$2 NO_HF=1 benchmarks/h200_run.sh $3 2>&1 | grep -E "===|tok/s|rror" ; }
run .scratch/trees/base warm_base tput128-w8kv8
run . warm_new tput128-w8kv8
run .scratch/trees/base base tput1000-w8kv8
run . new tput1000-w8kv8
run .scratch/trees/base base tput128-w8kv8
run . new tput128-w8kv8
