#!/usr/bin/env bash
# Call B: same-run A/B of the one-warp float8 decode tiles (this tree) against the four-warp
# rule (.scratch/trees/fourwarp: this tree's kiln with _FP8_ONE_WARP_PROGRAMS_PER_SM = 10**9).
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R KILN_TREE=$1 TAG=$2 benchmarks/h200_run.sh $3 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
F=.scratch/trees/fourwarp
run $F warm_fourwarp tput1000-w8kv8
run . warm_onewarp tput1000-w8kv8
run $F fourwarp tput1000-w8kv8
run . onewarp tput1000-w8kv8
run $F fourwarp tput128-w8kv8
run . onewarp tput128-w8kv8
run $F fourwarp2 tput1000-w8kv8
run . onewarp2 tput1000-w8kv8
grep -h '"command"' $R/*.json | sort | uniq -c
cd $R && tar czf $OUT/callB.tgz . && cd - >/dev/null && rm -rf $R
