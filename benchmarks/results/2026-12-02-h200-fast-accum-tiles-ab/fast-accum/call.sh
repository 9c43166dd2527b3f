#!/usr/bin/env bash
# Call A: the FP8 GEMM's fast accumulation (KILN_FP8_FAST_ACCUM) and the _scaled_mm forms.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback|GEMM|total" ; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
run benchmarks/h200_run.sh scaled-mm
TAG=acc0 run benchmarks/h200_run.sh profprefill-w8kv8
KILN_FP8_FAST_ACCUM=1 TAG=acc1 run benchmarks/h200_run.sh profprefill-w8kv8
TAG=acc0 run benchmarks/h200_run.sh tput128-w8kv8
KILN_FP8_FAST_ACCUM=1 TAG=acc1 run benchmarks/h200_run.sh tput128-w8kv8
TAG=acc0b run benchmarks/h200_run.sh tput128-w8kv8
KILN_FP8_FAST_ACCUM=1 TAG=acc1b run benchmarks/h200_run.sh tput128-w8kv8
ls -la $R
cd $R && tar czf $OUT/callA.tgz . && cd - >/dev/null && rm -rf $R
