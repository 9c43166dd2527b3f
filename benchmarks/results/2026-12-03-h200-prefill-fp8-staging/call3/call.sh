#!/usr/bin/env bash
# 2048/128 fp8-dynamic + float8 KV at 16384-token steps: main before the FMA fold (a9bfe4b,
# .scratch/base) against this tree, same machine as call 2 (warm).
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
KILN_TREE=.scratch/base TAG=base run benchmarks/h200_run.sh tput2048-16k-w8kv8
KILN_TREE=. TAG=fold run benchmarks/h200_run.sh tput2048-16k-w8kv8
cd $OUT && tar czf r.tgz r && rm -rf r
