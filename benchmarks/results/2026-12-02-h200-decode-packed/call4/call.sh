#!/usr/bin/env bash
# Call 4: FP8 activation quantization by the scale's reciprocal (+ the MUFU SiLU) against main:
# the quantizing kernels' times and codes, 128/128 and 2048/128 (16384-token steps), trees
# alternated (KILN_TREE=.scratch/base: main; .scratch/trecip: main + branch recip).
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
cd benchmarks
PYTHONPATH=../.scratch/base python3 quant_kernels_time.py --out $R/quant_base.json --codes $R/codes_base.pt
PYTHONPATH=../.scratch/trecip python3 quant_kernels_time.py --out $R/quant_recip.json --compare $R/codes_base.pt
rm -f $R/codes_base.pt
cd ..
KILN_TREE=.scratch/trecip TAG=warm run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=.scratch/base TAG=base run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=.scratch/trecip TAG=recip run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=.scratch/base TAG=base2 run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=.scratch/trecip TAG=recip2 run benchmarks/h200_run.sh tput128-w8kv8
KILN_TREE=.scratch/base TAG=base run benchmarks/h200_run.sh tput2048-16k-w8kv8
KILN_TREE=.scratch/trecip TAG=recip run benchmarks/h200_run.sh tput2048-16k-w8kv8

