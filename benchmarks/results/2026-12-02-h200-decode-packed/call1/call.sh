#!/usr/bin/env bash
# Call 1: the packed float8 decode kernel's sweep; 128/128 and 1000/1000 (768 in flight) with it
# off (base) and on (packed), FP8 W8A8 + float8 KV, alternated processes.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|x[0-9]+:|rror|Traceback" ; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.limit --format=csv
run benchmarks/h200_run.sh decode-packed
KILN_DECODE_PACKED=0 TAG=base run benchmarks/h200_run.sh tput128-w8kv8
KILN_DECODE_PACKED=1 TAG=packed run benchmarks/h200_run.sh tput128-w8kv8
KILN_DECODE_PACKED=0 TAG=base run benchmarks/h200_run.sh tput1000-768-w8kv8
KILN_DECODE_PACKED=1 TAG=packed run benchmarks/h200_run.sh tput1000-768-w8kv8
cd $R && tar czf $OUT/call1.tgz . && cd - >/dev/null && rm -rf $R
