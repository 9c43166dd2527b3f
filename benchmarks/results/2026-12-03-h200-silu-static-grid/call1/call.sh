#!/usr/bin/env bash
# Call 1: the static SiLU-mul + quantize column grid. GPU tests, the launch-shape sweep, the
# 8192-token prefill step profile of base (.scratch/base = git archive 90cd7b9) and of the
# change, then 2048/128 at 16384-token steps, the change and base.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -1
cp benchmarks/results/2026-12-03-h200-silu-static-grid/call1/expected.md $R/
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_reciprocal.py tests/test_fp8_linear.py -k "silu or reciprocal or quantizes" 2>&1 | tail -3 | tee $R/tests.txt
PYTHONPATH=. timeout 150 python3 benchmarks/silu_quant_sweep.py --static --out $R/silu_quant_static.json 2>&1 | cut -c1-400
P="--prefill --batch 4 --context 2048 --steps 4 --quantization fp8 --kv-cache-dtype fp8"
PYTHONPATH=.scratch/base timeout 100 python3 benchmarks/profile_decode.py $P --out $R/profile_prefill_base.txt 2>&1 | grep -E "rror|Trace"
PYTHONPATH=. timeout 100 python3 benchmarks/profile_decode.py $P --out $R/profile_prefill_grid.txt 2>&1 | grep -E "rror|Trace"
head -8 $R/profile_prefill_base.txt $R/profile_prefill_grid.txt
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
DMON=1 TAG=grid run benchmarks/h200_run.sh tput2048-16k-s8kv8
DMON=1 KILN_TREE=.scratch/base TAG=base run benchmarks/h200_run.sh tput2048-16k-s8kv8
cd $OUT && tar czf r.tgz r && rm -rf r
