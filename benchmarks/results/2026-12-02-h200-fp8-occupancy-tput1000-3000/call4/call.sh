#!/usr/bin/env bash
# Call 4: the fixed MLP hand-off tests on the GPU host (the rest of the file passed in call 3);
# decode attention's grid order (a sequence's KV heads as neighbouring programs) in the kernel
# sweep and end to end at 1000/1000 (KILN_DECODE_HEADS_FIRST A/B, after a warm-up process).
set -u
export NO_HF=1
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
R=$OUT/r; mkdir -p $R
PYTHONPATH=. timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_fp8_linear.py -k "hands_down_proj" 2>&1 | tail -30 > $R/test_fp8_linear_gpu_fixed.txt
PYTHONPATH=. timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_triton_kernels.py -k "decode" 2>&1 | tail -30 > $R/test_triton_kernels_decode_gpu.txt
tail -2 $R/test_fp8_linear_gpu_fixed.txt $R/test_triton_kernels_decode_gpu.txt
PYTHONPATH=. timeout 120 python3 benchmarks/decode_fp8_occupancy_sweep.py --heads-first-only --out $R/decode_heads_first.json 2>&1 | grep "heads first"
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
TAG=hf0 run benchmarks/h200_run.sh tput1000-w8kv8
KILN_DECODE_HEADS_FIRST=1 TAG=hf1 run benchmarks/h200_run.sh tput1000-w8kv8
TAG=hf0b run benchmarks/h200_run.sh tput1000-w8kv8
KILN_DECODE_HEADS_FIRST=1 TAG=hf1b run benchmarks/h200_run.sh tput1000-w8kv8
cd $R && tar czf $OUT/call4.tgz . && cd - >/dev/null && rm -rf $R
