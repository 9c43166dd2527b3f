#!/usr/bin/env bash
# Call 3: 1000/1000 at 3000 requests with 16384-token steps (packed decode kernel, the default),
# after a warm-up process.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
run benchmarks/h200_run.sh tput1000-3000-16k-w8kv8
cd $R && tar czf $OUT/call3.tgz . && cd - >/dev/null && rm -rf $R
