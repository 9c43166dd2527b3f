#!/usr/bin/env bash
# Call 1: the H200's read ceiling at float8 decode attention's access pattern; 1000/1000 at 3000
# requests with 768 and 960 in flight (static fp8 + float8 KV, 16384-token steps).
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $R/gpu.txt
cp benchmarks/results/2026-12-03-h200-read-ceiling-inflight/call1/expected.md $R/
PYTHONPATH=.:benchmarks timeout 150 python3 benchmarks/kv_read_ceiling.py --out $R/kv_read_ceiling.json 2>&1 | grep -v Warn | tee $R/ceiling.txt
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
# warm-up: the graphs and kernels of both runs (960 sequences, short outputs)
timeout 120 python3 -P -m kiln.cli.main bench throughput --model llama-3.1-8b --load-format dummy \
    --dtype bfloat16 --no-progress --quantization fp8 --kv-cache-dtype fp8 --input-len 1000 \
    --output-len 64 --num-requests 960 --max-num-seqs 960 --max-num-batched-tokens 16384 \
    --max-model-len 2048 --gpu-memory-utilization 0.95 --warmup 8 2>&1 | grep -E "tok/s|rror"
DMON=1 run benchmarks/h200_run.sh tput1000-3000-16k-s8kv8
DMON=1 run benchmarks/h200_run.sh tput1000-3000-16k-960-s8kv8
cd $OUT && tar czf r.tgz r && rm -rf r
