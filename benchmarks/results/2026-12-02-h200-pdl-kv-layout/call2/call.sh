#!/usr/bin/env bash
# Call 2: when a PDL kernel releases the next one. Call 1 released right after its own wait
# (the next kernel's programs resident, waiting, for the whole of this one): batch 1 fell from
# 357.6 to 301 tok/s. Here: release after the main loop (the default now), after the wait, never,
# against no PDL, alternated after a warm-up; the test again; a profile of the default.
set -u
export NO_HF=1
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback|passed|failed" ; }
TAG=warm run benchmarks/h200_run.sh lat1k-s8kv8h8
TAG=stream run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL=0 TAG=nopdl run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL_RELEASE=never TAG=never run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL_RELEASE=after-wait TAG=wait run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL_PREFETCH_TILES=0 TAG=stream_pf0 run benchmarks/h200_run.sh lat1k-s8kv8h8
TAG=stream_b run benchmarks/h200_run.sh lat1k-s8kv8h8
KILN_PDL=0 TAG=nopdl_b run benchmarks/h200_run.sh lat1k-s8kv8h8
TAG=stream run benchmarks/h200_run.sh prof1-s8kv8h8
run benchmarks/h200_run.sh test-pdl
cd $R && tar czf $OUT/call2.tgz . && cd - >/dev/null && rm -rf $R
