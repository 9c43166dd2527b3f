#!/usr/bin/env bash
# Call 3: tests/test_fp8_linear.py whole on the GPU host (what errors there); 128/128 twice after a
# warm-up; 2048/128 with 16384-token steps (the memory plan's profile through the shared helper);
# batch 1 with static fp8 and a float8 LM head beside dynamic.
set -u
export NO_HF=1
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R
PYTHONPATH=. timeout 240 python3 -m pytest -q -p no:cacheprovider -x --tb=short tests/test_fp8_linear.py -k "not smollm2" > $R/test_fp8_linear_gpu.txt 2>&1
PYTHONPATH=. timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_fp8_linear.py -k "not smollm2" 2>&1 | tail -25 > $R/test_fp8_linear_gpu_all.txt
tail -5 $R/test_fp8_linear_gpu_all.txt
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
run benchmarks/h200_run.sh tput128-w8kv8
TAG=b run benchmarks/h200_run.sh tput128-w8kv8
run benchmarks/h200_run.sh lat1k-w8kv8h8 lat1k-s8kv8h8 tput2048-16k-w8kv8
cd $R && tar czf $OUT/call3.tgz . && cd - >/dev/null && rm -rf $R
