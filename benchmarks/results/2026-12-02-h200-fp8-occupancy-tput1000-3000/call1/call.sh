#!/usr/bin/env bash
# Call 1: warm-up 128/128, the float8 decode occupancy sweep, 1000/1000 at 384 and at TRT-LLM's 3000 requests.
set -u
export NO_HF=1
python3 -m pip install -q --no-deps --no-index .scratch/wheels (server + jsonschema cp312 wheels, carried)/*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback|best|x[0-9]+: bf16" ; }
run benchmarks/h200_run.sh env tput128-w8kv8
run benchmarks/h200_run.sh fp8-occupancy
run benchmarks/h200_run.sh tput1000-w8kv8
cd $R && tar czf $OUT/call1.tgz . && cd - >/dev/null && rm -rf $R
