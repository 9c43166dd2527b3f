#!/usr/bin/env bash
# Call 3: padded decode grids (decode_waves_sweep.py --padding); a warm-up process; 1000/1000 at
# 3000 requests with 1000 and with 960 in flight, this tree.
set -u
export NO_HF=1
R=$OUT
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -1
PYTHONPATH=benchmarks:. timeout 150 python3 benchmarks/decode_waves_sweep.py --padding --out $R/decode_waves_padding.json 2>&1 | cut -c1-300 > $R/log.txt
grep -E "x1500|rror|Trace" $R/log.txt
PYTHONPATH=. timeout 120 python3 -P -m kiln.cli.main bench throughput --model llama-3.1-8b --load-format dummy --dtype bfloat16 --no-progress --quantization fp8 --kv-cache-dtype fp8 --input-len 1000 --output-len 64 --num-requests 1000 --max-num-seqs 1000 --max-num-batched-tokens 16384 --max-model-len 2000 --gpu-memory-utilization 0.985 --warmup 24 2>&1 | grep -E "tok/s|rror|Trace" | head -3
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" | tee -a $R/log.txt; }
DMON=1 run benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8
DMON=1 run benchmarks/h200_run.sh tput1000-3000-16k-960-s8kv8
