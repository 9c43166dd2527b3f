#!/usr/bin/env bash
# Call 3: o_proj's weight prefetched into L2 while batch-1 decode attention runs: GPU tests, the
# 32-layer chain micro-benchmark, batch 1 at 1k (static fp8 + float8 KV + float8 head) with and
# without, alternated after a warm-up process; a kernel profile with it.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
cp benchmarks/l2_prefetch_expected.md $R/
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback|passed|failed" ; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_l2_prefetch.py > $R/tests_gpu.txt 2>&1; tail -2 $R/tests_gpu.txt
PYTHONPATH=.:benchmarks timeout 150 python3 benchmarks/l2_prefetch_micro.py --out $R/l2_prefetch.json 2>&1 | grep -v Warn | tee $R/micro.txt
KILN_L2_PREFETCH_ROWS=1 TAG=warm run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_TREE=.scratch/base TAG=main run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_L2_PREFETCH_ROWS=1 KILN_L2_PREFETCH_MODE=0 TAG=pf0 run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_L2_PREFETCH_ROWS=1 KILN_L2_PREFETCH_MODE=1 TAG=pf1 run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_L2_PREFETCH_ROWS=1 KILN_L2_PREFETCH_MODE=2 TAG=pf2 run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_TREE=.scratch/base TAG=main2 run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_L2_PREFETCH_ROWS=0 TAG=off run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_L2_PREFETCH_ROWS=1 KILN_L2_PREFETCH_MODE=0 TAG=pf0b run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_L2_PREFETCH_ROWS=1 TAG=pf0 run benchmarks/h200_run.sh prof1-s8kv8h8
cd $OUT && tar czf r.tgz r && rm -rf r
