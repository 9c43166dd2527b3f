#!/usr/bin/env bash
# 2048/128 (3000 requests): FP8 dynamic and static at 16384-token steps, static at 32768, after a
# 128/128 warm-up process; this tree (prefill softmax FMA fold).
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $R/gpu.txt
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
KILN_TREE=. TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=. run benchmarks/h200_run.sh tput2048-16k-w8kv8
KILN_TREE=. run benchmarks/h200_run.sh tput2048-16k-s8kv8
KILN_TREE=. run benchmarks/h200_run.sh tput2048-32k-s8kv8
cd $OUT && tar czf r.tgz r && rm -rf r
