#!/usr/bin/env bash
# Call D: the FP8 kernels' GPU tests with fast accumulation the default; 1000/1000 and batch 1 on this tree.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
PYTHONPATH=. timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py tests/test_fp8_lm_head.py tests/test_split_k_linear.py -k "not smollm2" 2>&1 | tail -15 | tee $R/gpu_tests.txt
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
TAG=warm run benchmarks/h200_run.sh tput1000-w8kv8
run benchmarks/h200_run.sh tput1000-w8kv8 lat1k-w8kv8h8
cd $R && tar czf $OUT/callD.tgz . && cd - >/dev/null && rm -rf $R
