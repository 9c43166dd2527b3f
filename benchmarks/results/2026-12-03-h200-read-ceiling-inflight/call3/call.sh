#!/usr/bin/env bash
# Call 3: the static scale column kept (fp8_gemm._static_column): GPU tests, the 960-row decode
# step profile of main (.scratch/base: `git archive` of the commit before) and of the change,
# then 1000/1000 at 3000 requests with 960 in flight, the change and main.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -1
cp benchmarks/results/2026-12-03-h200-read-ceiling-inflight/call3/expected.md $R/
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py -k "llama8b_shapes or static_column" 2>&1 | tail -3 | tee $R/tests.txt
P="--batch 960 --context 1500 --quantization fp8 --kv-cache-dtype fp8"
PYTHONPATH=.scratch/base timeout 100 python3 benchmarks/profile_decode.py $P --out $R/profile_b960_main.txt 2>&1 | grep -E "rror|Trace"
PYTHONPATH=. timeout 100 python3 benchmarks/profile_decode.py $P --out $R/profile_b960_column.txt 2>&1 | grep -E "rror|Trace"
head -3 $R/profile_b960_main.txt $R/profile_b960_column.txt
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
DMON=1 TAG=column run benchmarks/h200_run.sh tput1000-3000-16k-960-s8kv8
DMON=1 KILN_TREE=.scratch/base TAG=main run benchmarks/h200_run.sh tput1000-3000-16k-960-s8kv8
cd $OUT && tar czf r.tgz r && rm -rf r
