#!/usr/bin/env bash
# 128/128 (FP8 + float8 KV, 2048 requests, 512 in flight) with the host's per-step Python cut
# (merge ea880f8) against the tree before it (2415bd0's kiln, carried as .scratch/base),
# alternated after a warm-up process; then the CPU tool's split of the host's step on this host.
set -u
export NO_HF=1
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
T0=$SECONDS
TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
for pass in 1 2 3; do
    (( SECONDS - T0 > 330 )) && break
    KILN_TREE=.scratch/base TAG=base$pass run benchmarks/h200_run.sh tput128-w8kv8
    TAG=new$pass run benchmarks/h200_run.sh tput128-w8kv8
done
if (( SECONDS - T0 < 420 )); then
    OMP_NUM_THREADS=1 PYTHONPATH=. timeout 90 python3 benchmarks/step_host_batch_cpu.py \
        --out $R/step_host_batch_new.json 2>&1 | tail -3
fi
cd $R && tar czf $OUT/call.tgz . && cd - >/dev/null && rm -rf $R
