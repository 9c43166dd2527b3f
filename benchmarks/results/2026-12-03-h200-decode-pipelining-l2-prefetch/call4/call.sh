#!/usr/bin/env bash
# Call 4 (two device calls, the same lease as calls 1-3): 1000/1000 as TensorRT-LLM runs it
# (3000 requests, 768 in flight), static fp8 + float8 KV: main against the natural-order packed
# kernel of call 1 (8-key sub-tiles, one warp, three stages), 16384-token steps; then main at
# 32768-token steps. .scratch/base: `git archive 76a68cb kiln`; .scratch/pftree: the same with
# call1/decode_pf.patch applied.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -1
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
KILN_TREE=.scratch/base TAG=main run benchmarks/h200_run.sh tput1000-3000-16k-s8kv8
KILN_TREE=.scratch/pftree KILN_PF=8,1,0,1,3 TAG=pf run benchmarks/h200_run.sh tput1000-3000-16k-s8kv8
# second call
PYTHONPATH=.scratch/base timeout 270 python3 -P -m kiln.cli.main bench throughput \
    --model llama-3.1-8b --load-format dummy --dtype bfloat16 --no-progress --quantization fp8 \
    --kv-cache-dtype fp8 --input-len 1000 --output-len 1000 --num-requests 3000 \
    --max-num-seqs 768 --max-num-batched-tokens 32768 --max-model-len 2048 --warmup 24 \
    --output-json $R/tput1000_3000_32k_fp8s_fp8kv.json
