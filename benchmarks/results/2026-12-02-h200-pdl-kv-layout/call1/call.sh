#!/usr/bin/env bash
# Call 1: programmatic dependent launch (kernels/triton/_pdl.py) at batch 1. Its test on the GPU
# (the decode chain in a graph, bit-equal with and without PDL) and the MLP hand-off test; then
# batch 1 at 1k context, static fp8 + float8 KV + float8 LM head (357.6 tok/s last run) and
# fp8-dynamic (341.9), with PDL (prefetch 2 tiles: the default), without it, and prefetch 0 / 4,
# alternated after a warm-up process; kernel profiles of the static step with and without PDL.
set -u
export NO_HF=1
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback|passed|failed" ; }
run benchmarks/h200_run.sh test-pdl
TAG=warm run benchmarks/h200_run.sh lat1k-s8kv8h8
TAG=pdl run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL=0 TAG=nopdl run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL_PREFETCH_TILES=0 TAG=pdl_pf0 run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL_PREFETCH_TILES=4 TAG=pdl_pf4 run benchmarks/h200_run.sh lat1k-s8kv8h8
TAG=pdl_b run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL=0 TAG=nopdl_b run benchmarks/h200_run.sh lat1k-s8kv8h8
TAG=pdl run benchmarks/h200_run.sh lat1k-w8kv8h8
KILN_PDL=0 TAG=nopdl run benchmarks/h200_run.sh lat1k-w8kv8h8
TAG=pdl run benchmarks/h200_run.sh prof1-s8kv8h8
KILN_PDL=0 TAG=nopdl run benchmarks/h200_run.sh prof1-s8kv8h8
cd $R && tar czf $OUT/call1.tgz . && cd - >/dev/null && rm -rf $R
