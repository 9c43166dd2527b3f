#!/usr/bin/env bash
# Call 3 (KILN_PDL=0 throughout: the tree without PDL, as it lands): what earlier runs left
# owed. bf16 1000/1000 (384 in flight) with decode attention's grid heads first (the engine's
# order over bf16 caches since the last run, measured per layer only) against sequences first,
# after a warm-up; 2048/128 at 512 in flight with 8192- and 16384-token steps in one run.
set -u
export NO_HF=1 KILN_PDL=0
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback|passed|failed" ; }
TAG=warm run benchmarks/h200_run.sh tput1000
KILN_DECODE_HEADS_FIRST=1 TAG=heads_first run benchmarks/h200_run.sh tput1000
KILN_DECODE_HEADS_FIRST=0 TAG=seqs_first run benchmarks/h200_run.sh tput1000
run benchmarks/h200_run.sh tput2048-512seqs-w8kv8 tput2048-16k-w8kv8
cd $R && tar czf $OUT/call3.tgz . && cd - >/dev/null && rm -rf $R
