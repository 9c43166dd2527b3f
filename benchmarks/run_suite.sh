#!/usr/bin/env bash
# kiln's benchmark suite on one machine with CUDA GPUs: one command per published row, the GPU
# tests and the product benchmarks. Llama-3.1-8B (and 70B) shapes with dummy weights.
#
# Usage, from the repository root:
#   benchmarks/run_suite.sh                 every published row (ROWS below) this card holds
#   benchmarks/run_suite.sh ROW...          the named rows or benchmarks, in order
#   benchmarks/run_suite.sh --list          the names and their commands, nothing run
#   OUT=DIR benchmarks/run_suite.sh ...     where the JSON goes (default benchmarks/out/DATE-GPU,
#                                           not committed); each name writes OUT/NAME.json
#   PYTHON=python3.12 ...                   the interpreter (default python3)
# Compare a run with the recorded baselines (the run ends with this against the card's own,
# and exits 1 when a row's headline metric is more than TOLERANCE, default 3%, below it):
#   python3 benchmarks/bench_summary.py OUT --baseline benchmarks/baselines/h200.json
#   python3 -m kiln.cli.main bench compare benchmarks/baselines/h200.json OUT --tolerance 3%
# Each command has its own time limit, so one that hangs or fails leaves the others their time.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Multi-GPU runs keep NVLink multicast off (the lent machines' rule; harmless elsewhere).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

BENCH="$PY -P -m kiln.cli.main bench"
E8="--model llama-3.1-8b --load-format dummy --dtype bfloat16"  # the engine flags
M8="$E8 --no-progress"
M70="--model llama-3.1-70b --load-format dummy --dtype bfloat16 --no-progress"
FP8="--quantization fp8 --kv-cache-dtype fp8"  # static FP8 weights + float8 KV (TRT-LLM's FP8)
ROWS="8b_fp8_128x128 8b_fp8_1000x1000 8b_fp8_2048x128 8b_fp8_5000x500 8b_fp8_20000x2000
      8b_fp8_100k_prompt 8b_fp8_batch1_decode 8b_bf16_batch1_decode 70b_fp8_128x128 70b_fp8_batch1_decode"
# The model families beside Llama (docs/performance.md): PRESET_fp8dyn_batch1 / _1000x1000.
FAMILY_ROWS=$(for m in llama-3.1-8b qwen3-8b gemma-2-9b gemma-3-12b phi-4; do
    echo "${m}_fp8dyn_batch1 ${m}_fp8dyn_1000x1000"; done)
# The quantization matrix on the 8B (docs/performance.md): quant_Q_128x128 (no HF baseline),
# quant_Q_c32_1000x1000 (32 in flight) and quant_Q_batch1 for Q in fp8, int4 (W4A16, groups of
# 128), w8a8 (INT8 weights and activations), each with the float8 KV cache.
QUANT_ROWS=$(for q in fp8 int4 w8a8; do
    echo "quant_${q}_128x128 quant_${q}_c32_1000x1000 quant_${q}_batch1"; done)
quant_flags() {  # fp8 | int4 | w8a8 -> the --quantization flags
    case $1 in fp8) echo "$FP8" ;; int4) echo "--quantization int4-g128 --kv-cache-dtype fp8" ;;
    w8a8) echo "--quantization int8-w8a8 --kv-cache-dtype fp8" ;; esac
}
# Long prompts against the memory plan: the most 32k-token sequences run at once in a 16 GiB
# float8 pool beside the plan's count (Gemma-3-12B's windowed layers hold their window: 12 fit,
# 2 if every layer kept its whole context; Llama-3.1-8B, the control without windows: 8).
FIT_ROWS="gemma-3-12b_fp8dyn_long32k_fit llama-3.1-8b_fp8dyn_long32k_fit"
# The test files with GPU-only tests (those that exist: the list outlives renames).
GPU_TESTS=$(for f in ${GPU_TESTS:-tests/runtime/test_gpu.py tests/kernels/test_triton_kernels.py \
    tests/kernels/test_kernel_twins.py tests/layers/test_fp8_linear.py \
    tests/kernels/test_split_k_linear.py tests/layers/test_outlier_columns.py \
    tests/kernels/test_qk_norm_rotary.py tests/kernels/test_attention_kinds.py \
    tests/kernels/test_block_kernels.py tests/models/test_family_kernels.py \
    tests/kernels/test_int4_gemm.py tests/kernels/test_fused_moe.py \
    tests/models/test_moe_kernels.py tests/kernels/test_fused_moe_biased.py \
    tests/models/test_gpt_oss.py tests/kernels/test_moe_decode.py tests/kernels/test_moe_fp8.py \
    tests/kernels/test_moe_fp8_block.py tests/kernels/test_moe_int4.py \
    tests/kernels/test_moe_router.py tests/kernels/test_eight_bit_gemms.py \
    tests/kernels/test_int8_kv_cache.py tests/kernels/test_lora_kernels.py \
    tests/models/test_gemma2_gemma3.py tests/models/test_deepseek.py tests/kernels/test_mla_decode.py \
    tests/models/test_deepseek_triton.py tests/kernels/test_moe_w8a16.py \
    tests/kernels/test_prefill_attention_hopper.py tests/kernels/test_int4_gemm_hopper.py \
    tests/kernels/test_layer_norm_kernels.py}; do
    [[ -e $f ]] && echo "$f"; done)

command_of() {  # NAME -> "SECONDS COMMAND..." (O is the output folder)
    case $1 in
    8b_fp8_128x128) echo 300 $BENCH throughput $M8 $FP8 --input-len 128 --output-len 128 \
        --num-requests 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-model-len 256 \
        --warmup 192 --baseline hf --hf-batch-size 64 --output-json "$O/$1.json" ;;
    8b_fp8_1000x1000) echo 500 $BENCH throughput $M8 $FP8 --input-len 1000 --output-len 1000 \
        --num-requests 3000 --max-num-seqs 1000 --max-num-batched-tokens 16384 \
        --max-model-len 2000 --gpu-memory-utilization 0.985 --warmup 24 \
        --output-json "$O/$1.json" ;;
    8b_fp8_2048x128) echo 400 $BENCH throughput $M8 $FP8 --input-len 2048 --output-len 128 \
        --num-requests 3000 --max-num-seqs 512 --max-num-batched-tokens 16384 \
        --max-model-len 2176 --warmup 12 --output-json "$O/$1.json" ;;
    8b_fp8_5000x500) echo 600 $BENCH throughput $M8 $FP8 --input-len 5000 --output-len 500 \
        --num-requests 1000 --max-num-seqs 512 --max-num-batched-tokens 16384 \
        --max-model-len 5500 --gpu-memory-utilization 0.95 --warmup 8 --output-json "$O/$1.json" ;;
    8b_fp8_20000x2000) echo 600 $BENCH throughput $M8 $FP8 --input-len 20000 --output-len 2000 \
        --num-requests 168 --max-num-seqs 84 --max-num-batched-tokens 16384 \
        --max-model-len 22000 --gpu-memory-utilization 0.95 --warmup 2 --output-json "$O/$1.json" ;;
    # One 100,000-token prompt (16k-token chunks), then 256 tokens at that context: its time to
    # first token and its decode's fraction of the bytes' roofline.
    8b_fp8_100k_prompt) echo 400 $BENCH latency $M8 $FP8 --input-len 100000 --output-len 256 \
        --num-requests 2 --max-num-batched-tokens 16384 --max-model-len 100352 \
        --gpu-memory-utilization 0.95 --output-json "$O/$1.json" ;;
    8b_fp8_batch1_decode) echo 200 $BENCH latency $M8 $FP8 --lm-head-quantization fp8 \
        --input-len 1024 --output-len 128 --num-requests 3 --max-model-len 1280 \
        --output-json "$O/$1.json" ;;
    8b_bf16_batch1_decode) echo 200 $BENCH latency $M8 --input-len 1024 --output-len 128 \
        --num-requests 3 --max-model-len 1280 --baseline hf --output-json "$O/$1.json" ;;
    70b_fp8_128x128) echo 600 $BENCH throughput $M70 $FP8 --input-len 128 --output-len 128 \
        --num-requests 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 --max-model-len 256 \
        --warmup 192 --output-json "$O/$1.json" ;;
    70b_fp8_batch1_decode) echo 400 $BENCH latency $M70 $FP8 --input-len 1024 --output-len 128 \
        --num-requests 3 --max-model-len 1280 --output-json "$O/$1.json" ;;
    quant_*_128x128 | quant_*_c32_1000x1000 | quant_*_batch1) local q=${1#quant_} && q=${q%%_*}
        [[ -n $(quant_flags "$q") ]] || return 1
        case $1 in
        *_128x128) echo 300 $BENCH throughput $M8 $(quant_flags "$q") --input-len 128 \
            --output-len 128 --num-requests 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 \
            --max-model-len 256 --warmup 192 --output-json "$O/$1.json" ;;
        *_c32_1000x1000) echo 300 $BENCH throughput $M8 $(quant_flags "$q") --input-len 1000 \
            --output-len 1000 --num-requests 96 --max-num-seqs 32 --max-num-batched-tokens 8192 \
            --max-model-len 2048 --warmup 8 --output-json "$O/$1.json" ;;
        *) echo 200 $BENCH latency $M8 $(quant_flags "$q") --input-len 1024 --output-len 128 \
            --num-requests 3 --max-model-len 1280 --max-num-seqs 1 --output-json "$O/$1.json" ;;
        esac ;;
    *_fp8dyn_batch1) echo 200 $BENCH latency --model "${1%_fp8dyn_batch1}" --load-format dummy \
        --dtype bfloat16 --no-progress --quantization fp8-dynamic --kv-cache-dtype fp8 \
        --input-len 1024 --output-len 128 --num-requests 3 --max-model-len 1280 \
        --output-json "$O/$1.json" ;;
    *_fp8dyn_1000x1000) echo 300 $BENCH throughput --model "${1%_fp8dyn_1000x1000}" \
        --load-format dummy --dtype bfloat16 --no-progress --quantization fp8-dynamic \
        --kv-cache-dtype fp8 --input-len 1000 --output-len 1000 --num-requests 256 \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2048 --warmup 32 \
        --output-json "$O/$1.json" ;;
    # Prompts start faster than they end (four 8192-token chunks each, 128 tokens out), so the
    # pool, not the prompts' pace, limits how many run at once (tests/engine/test_occupancy.py).
    *_fp8dyn_long32k_fit) echo 240 $BENCH throughput --model "${1%_fp8dyn_long32k_fit}" \
        --load-format dummy --dtype bfloat16 --no-progress --quantization fp8-dynamic \
        --kv-cache-dtype fp8 --input-len 32640 --output-len 128 --num-requests 16 \
        --max-num-seqs 64 --max-num-batched-tokens 8192 --max-model-len 32768 \
        --kv-cache-memory-gb 16 --warmup 0 --output-json "$O/$1.json" ;;
    tests) echo 600 $PY -m pytest -q -p no:cacheprovider $GPU_TESTS ;;
    tests_parallel) echo 400 env KILN_PARALLEL_TEST_DEVICE=cuda $PY -m pytest -q -x \
        -p no:cacheprovider tests/distributed/test_parallel.py ;;
    kernels) echo 300 $PY benchmarks/kernels_gpu.py "$O/$1.json" ;;
    kernels_long) echo 400 $PY benchmarks/kernels_gpu.py --long "$O/$1.json" ;;
    serve) echo 560 $PY benchmarks/serve_vs_offline.py --out "$O/$1" --shapes 128x128 \
        --concurrency 1 64 256 --requests-per-concurrency 2 --check-client-from 256 \
        --min-requests 8 -- $E8 ;;
    startup) echo 300 $PY benchmarks/startup.py health --runs 3 --port 8131 \
        --output-json "$O/$1.jsonl" -- $PY -m kiln.cli.main serve --port 8131 $E8 ;;
    build) echo 500 $PY benchmarks/build_and_first_token.py --preset llama-3.1-8b \
        --work /tmp/kiln-suite-build --quantization fp8-dynamic --output-json "$O/$1.json" ;;
    spec) echo 560 $PY benchmarks/spec_decode_gpu.py $E8 --out "$O/$1.json" ;;
    structured) echo 600 $PY benchmarks/structured_output_bench.py $E8 --num-requests 64 \
        --input-len 128 --output-len 128 --rounds 5 --out "$O/$1.json" ;;
    beams) echo 400 $PY benchmarks/beam_search_bench.py $E8 --width 4 --input-len 128 \
        --output-len 64 --repeats 3 --out "$O/$1.json" ;;
    kv_accuracy) echo 600 $PY benchmarks/kv_cache_accuracy.py --out "$O/$1.json" ;;
    profile) echo 200 $PY benchmarks/profile_decode.py --batch 1 --context 1024 $FP8 \
        --lm-head-quantization fp8 --out "$O/$1.txt" ;;
    tiles) echo 400 $PY benchmarks/tile_tuner.py --out "$O/$1.json" ;;
    *) return 1 ;;
    esac
}

gib=$($PY -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)" \
    2>/dev/null || echo 0)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
O=${OUT:-benchmarks/out/$(date +%F)-$(echo "${gpu:-gpu}" | tr ' ' '_')}
if [[ ${1:-} == --list ]]; then
    shift
    for name in ${*:-$ROWS $FAMILY_ROWS $QUANT_ROWS $FIT_ROWS tests tests_parallel kernels kernels_long serve \
        startup build spec structured beams kv_accuracy profile tiles}; do
        echo "$name: $(command_of "$name" | cut -d' ' -f2-)"
    done
    exit 0
fi
mkdir -p "$O"
echo "=== $gpu, ${gib} GiB; output $O; $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv 2>/dev/null
for name in ${*:-$ROWS}; do
    if ! spec=$(command_of "$name"); then
        echo "=== unknown name $name (--list shows them)"
        continue
    fi
    if [[ $name == 70b_* && $gib -lt 100 ]]; then  # 70B FP8 weights alone are ~68 GiB
        echo "=== $name: skipped, ${gib} GiB is too little for the 70B in FP8 on one card"
        continue
    fi
    limit=${spec%% *}
    echo "=== $name ($(date +%T), limit ${limit}s): ${spec#* }"
    t0=$SECONDS
    # shellcheck disable=SC2086  # the command is a word list by design
    timeout --kill-after=10 "$limit" ${spec#* } >"$O/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0))s; log $O/$name.log"
done
$PY benchmarks/bench_summary.py "$O"
case "$gpu" in  # the card's recorded baselines, if it has them
*H200*) base=benchmarks/baselines/h200.json ;;
*H100*) base=benchmarks/baselines/h100.json ;;
*) base="" ;;
esac
if [[ -n $base ]] && ls "$O"/*.json >/dev/null 2>&1; then
    echo "=== against $base (judged: output_tok_s, decode_tok_s)"
    $PY -m kiln.cli.main bench compare "$base" "$O" --tolerance "${TOLERANCE:-3%}" \
        --metrics output_tok_s,decode_tok_s
    status=$?
    exit $((status == 1))  # 2: no published row ran, nothing to judge
fi
