#!/usr/bin/env bash
# Call 2: the packed decode kernel's in-kernel split merge (no reduce kernel) at batch 1:
# its GPU tests, batch 1 at 1k context (static fp8 + float8 KV + float8 head) alternated with
# main after a warm-up process, a kernel profile of the merged step.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
cp .scratch/dp/expected2.md $R/ 2>/dev/null
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback|passed|failed" ; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "decode" > $R/tests_gpu.txt 2>&1; tail -2 $R/tests_gpu.txt
KILN_TREE=. TAG=warm run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_TREE=.scratch/base TAG=main run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_TREE=. TAG=merge run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_TREE=.scratch/base TAG=main2 run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_TREE=. TAG=merge2 run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_TREE=. TAG=merge run benchmarks/h200_run.sh prof1-s8kv8h8
