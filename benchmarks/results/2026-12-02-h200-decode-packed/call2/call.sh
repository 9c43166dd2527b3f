#!/usr/bin/env bash
# Call 2: packed on by default. 1000/1000 as TensorRT-LLM runs it (3000 requests, 768 in
# flight); 128/128 alternated packed/base; 2048/128 (3000 requests, 512 in flight, 16k steps).
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
TAG=packed run benchmarks/h200_run.sh tput1000-3000-w8kv8
KILN_DECODE_PACKED=0 TAG=base run benchmarks/h200_run.sh tput128-w8kv8
TAG=packed run benchmarks/h200_run.sh tput128-w8kv8
TAG=packed run benchmarks/h200_run.sh tput2048-16k-w8kv8
cd $R && tar czf $OUT/call2.tgz . && cd - >/dev/null && rm -rf $R
