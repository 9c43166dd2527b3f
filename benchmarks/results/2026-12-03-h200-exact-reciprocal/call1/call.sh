#!/usr/bin/env bash
# Exact reciprocal quantization: GPU tests, kernel times and codes (base / bare product / exact),
# 128/128 alternated after a warm-up process.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $R/gpu.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_reciprocal.py tests/test_fp8_linear.py tests/test_split_k_linear.py > $R/tests_gpu.txt 2>&1
tail -3 $R/tests_gpu.txt
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
cd benchmarks
PYTHONPATH=../.scratch/base python3 quant_kernels_time.py --out $R/quant_base.json --codes $R/codes_base.pt 2>&1 | tail -1
PYTHONPATH=../.scratch/tbare python3 quant_kernels_time.py --out $R/quant_bare.json --compare $R/codes_base.pt 2>&1 | tail -1
PYTHONPATH=.. python3 quant_kernels_time.py --out $R/quant_exact.json --compare $R/codes_base.pt 2>&1 | tail -1
rm -f $R/codes_base.pt
cd ..
KILN_TREE=. TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=.scratch/base TAG=base run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=. TAG=exact run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=.scratch/base TAG=base2 run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=. TAG=exact2 run benchmarks/h200_run.sh tput128-w8kv8
