#!/usr/bin/env bash
# Same-run A/B of tput128-w8kv8 across trees (the 128/128 FP8 regression since 6451c35)
python3 -m pip install -q --no-deps --no-index shared/wheels/*.whl .scratch/wheels/*.whl 2>&1 | tail -2
run() { KILN_TREE=$1 TAG=$2 NO_HF=1 benchmarks/h200_run.sh tput128-w8kv8 2>&1 | grep -E "===|tok/s|rror" ; }
run . head1
for c in 6451c35 4713a9e 1c8fd95 80e3004; do run .scratch/trees/$c $c; done
run . head2
