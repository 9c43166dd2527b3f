#!/usr/bin/env bash
# Call 5: 2048/128 at 8192-token steps beside 16384 in one run.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
run benchmarks/h200_run.sh tput2048-512seqs-w8kv8 tput2048-16k-w8kv8
cd $R && tar czf $OUT/call5.tgz . && cd - >/dev/null && rm -rf $R
