#!/usr/bin/env bash
# Call 2: 1000/1000 as TensorRT-LLM runs it (3000 requests, 768 in flight), after a warm-up.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
run benchmarks/h200_run.sh tput1000-3000-w8kv8
cd $R && tar czf $OUT/call2.tgz . && cd - >/dev/null && rm -rf $R
