#!/usr/bin/env bash
# Call C: fast accumulation on by default; static fp8 (TensorRT-LLM's setup) beside fp8-dynamic.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
TAG=warm run benchmarks/h200_run.sh tput128-s8kv8
run benchmarks/h200_run.sh tput128-w8kv8 tput128-s8kv8
TAG=b run benchmarks/h200_run.sh tput128-w8kv8 tput128-s8kv8
run benchmarks/h200_run.sh profprefill-s8kv8 tput2048-512seqs-w8kv8 tput2048-512seqs-s8kv8
cd $R && tar czf $OUT/callC.tgz . && cd - >/dev/null && rm -rf $R
