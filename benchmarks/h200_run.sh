#!/usr/bin/env bash
# One H200 run: GPU correctness tests and the issue-4 benchmark set, Llama-3.1-8B shape, dummy
# weights, bf16. Usage: benchmarks/h200_run.sh STAGE... (see the case below), from the repository
# root. JSON and the log go to $OUT (the device tool's folder) if it is set, else to
# benchmarks/results/$RUN_NAME, named by date and what was measured: RUN_NAME defaults to
# DATE-h200-STAGES (e.g. 2026-11-30-h200-tput1000-fp8nopf-tput1000-fp8); a folder that comes back
# from the device is committed under benchmarks/results/ by the same rule. Each stage has its own
# time limit, so one that hangs or fails leaves the others their time.
set -u
STAGES=$(IFS=-; echo "$*")
OUT=${OUT:-benchmarks/results/${RUN_NAME:-$(date +%F)-h200-${STAGES:-none}}}
mkdir -p "$OUT"
# KILN_TREE: run another checkout's kiln (e.g. an extracted older commit) for a same-run A/B;
# TAG: appended to every output name (lat1k_TAG.json); NO_HF=1: skip the HF baselines.
export PYTHONPATH=${KILN_TREE:-.}
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false
# -P: `python3 -m` would put the working directory first on sys.path, so KILN_TREE's kiln would
# lose to the checkout's (every KILN_TREE A/B of `kiln bench` before 2026-12-02's second run ran
# this tree on both sides)
BENCH="python3 -P -m kiln.cli.main bench"
COMMON="--model llama-3.1-8b --load-format dummy --dtype bfloat16 --no-progress"

stage() {  # name, seconds, command...
    local name=$1$SFX limit=$2
    shift 2
    echo "=== $name ($(date +%T), limit ${limit}s)"
    local t0=$SECONDS dmon=""
    if [[ -n ${DMON:-} ]] && command -v nvidia-smi >/dev/null; then
        # DMON=1: the GPU's power, temperature and clocks every 2 s (sustained-load throttling)
        nvidia-smi dmon -s pc -d 2 -o T >"$OUT/dmon_$name.txt" 2>&1 &
        dmon=$!
    fi
    timeout --kill-after=10 "$limit" "$@"
    echo "=== $name: exit $? after $((SECONDS - t0))s"
    [[ -n $dmon ]] && kill "$dmon"
}

for s in "$@"; do
    # A suffix runs a benchmark stage as a variant, with no HF baseline (the one in the plain
    # stage of the same run is the comparison), and writes NAME_SUFFIX.json: "-fp8" a float8
    # KV cache ("-fp8nopf": without the float8 decode kernel's V prefetch), "-gc0" Python's
    # default GC threshold (the engine raises it; A/B of that), "-fp8w" FP8 W8A8 weights
    # (--quantization fp8-dynamic), "-w8kv8" FP8 weights and a float8 KV cache together,
    # "-fp8wh8" / "-w8kv8h8" those with a float8 LM head (--lm-head-quantization fp8), "-s8kv8"
    # static fp8 (--quantization fp8) with a float8 KV cache ("-s8kv8h8": and a float8 LM head).
    VARIANT="" SFX="" HF_BASELINE="--baseline hf"
    unset KILN_PREFETCH_FP8_V
    if [[ $s == *-fp8nopf ]]; then  # float8 without the decode kernel's V prefetch: its A/B
        s=${s%-fp8nopf} VARIANT="--kv-cache-dtype fp8" SFX=_fp8_noprefetch HF_BASELINE=""
        export KILN_PREFETCH_FP8_V=0
    elif [[ $s == *-fp8 ]]; then
        s=${s%-fp8} VARIANT="--kv-cache-dtype fp8" SFX=_fp8 HF_BASELINE=""
    elif [[ $s == *-fp8w ]]; then  # FP8 W8A8 weights, dynamic per-token activations
        s=${s%-fp8w} VARIANT="--quantization fp8-dynamic" SFX=_fp8w HF_BASELINE=""
    elif [[ $s == *-w8kv8 ]]; then  # FP8 W8A8 weights and a float8 KV cache: TRT-LLM's FP8 setup
        s=${s%-w8kv8} VARIANT="--quantization fp8-dynamic --kv-cache-dtype fp8" SFX=_fp8w_fp8kv
        HF_BASELINE=""
    elif [[ $s == *-s8kv8 ]]; then  # static FP8 (per-tensor input scales; dummy weights get
        # stand-in ones) and a float8 KV cache: ModelOpt's FP8 checkpoints, TensorRT-LLM's setup
        s=${s%-s8kv8} VARIANT="--quantization fp8 --kv-cache-dtype fp8" SFX=_fp8s_fp8kv
        HF_BASELINE=""
    elif [[ $s == *-s8kv8h8 ]]; then  # static FP8, a float8 KV cache and a float8 LM head
        s=${s%-s8kv8h8} SFX=_fp8s_fp8kv_fp8head HF_BASELINE=""
        VARIANT="--quantization fp8 --kv-cache-dtype fp8 --lm-head-quantization fp8"
    elif [[ $s == *-w8kv8h8 ]]; then  # ... and the LM head in float8 (--lm-head-quantization)
        s=${s%-w8kv8h8} SFX=_fp8w_fp8kv_fp8head HF_BASELINE=""
        VARIANT="--quantization fp8-dynamic --kv-cache-dtype fp8 --lm-head-quantization fp8"
    elif [[ $s == *-fp8wh8 ]]; then  # FP8 W8A8 weights and a float8 LM head
        s=${s%-fp8wh8} VARIANT="--quantization fp8-dynamic --lm-head-quantization fp8"
        SFX=_fp8w_fp8head HF_BASELINE=""
    elif [[ $s == *-gc0 ]]; then
        s=${s%-gc0} VARIANT="--gc-gen0-threshold 0" SFX=_gc0 HF_BASELINE=""
    fi
    SFX=$SFX${TAG:+_$TAG}
    [[ -n ${NO_HF:-} ]] && HF_BASELINE=""
    case $s in
    env)
        nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
        python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
        ;;
    test-gpu)
        stage test-gpu 170 python3 -m pytest -q -x -p no:cacheprovider -s tests/test_gpu.py
        ;;
    test-graph-cpu)
        stage test-graph-cpu 60 python3 -m pytest -q -p no:cacheprovider tests/test_graph_runner.py
        ;;
    test-kernels)
        stage test-kernels 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py
        ;;
    sweep)  # the throughput-latency curve, 1000/128, 4x the level in requests (256: 1024)
        stage sweep 420 $BENCH sweep $COMMON $VARIANT --concurrency 1,8,64,256 \
            --input-len 1000 --output-len 128 --output-json "$OUT/sweep$SFX.json"
        ;;
    startup)  # cold process to the first token / healthy, dummy 8B and the embedded SmolLM2
        stage startup 300 bash -c "python3 benchmarks/startup.py generate --runs 3 \
            --output-json $OUT/startup$SFX.jsonl -- python3 -P -m kiln.cli.main generate \
            --max-tokens 8 'What is the capital of France?' && python3 benchmarks/startup.py \
            health --runs 3 --port 8131 --output-json $OUT/startup$SFX.jsonl -- python3 -m \
            kiln.cli.main serve --port 8131 $COMMON"
        ;;
    lat1k)  # batch-1 decode at 1k context: roofline fraction; HF generate on one request
        stage lat1k 150 $BENCH latency $COMMON $VARIANT --input-len 1024 --output-len 128 \
            --num-requests 3 --max-model-len 1280 $HF_BASELINE --output-json "$OUT/lat1k$SFX.json"
        ;;
    lat1k-eager)
        stage lat1k-eager 90 $BENCH latency $COMMON $VARIANT --input-len 1024 --output-len 128 \
            --num-requests 3 --max-model-len 1280 --enforce-eager --output-json "$OUT/lat1k_eager$SFX.json"
        ;;
    ttft2k)  # time to first token of a 2048-token prompt at batch 1
        stage ttft2k 120 $BENCH latency $COMMON $VARIANT --input-len 2048 --output-len 4 \
            --num-requests 5 --max-model-len 2176 $HF_BASELINE --output-json "$OUT/ttft2k$SFX.json"
        ;;
    tput128)  # 128/128 max throughput; HF generate on one static batch of 64
        stage tput128 170 $BENCH throughput $COMMON $VARIANT --input-len 128 --output-len 128 \
            --num-requests 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 \
            --max-model-len 256 --warmup 192 $HF_BASELINE --hf-batch-size 64 \
            --output-json "$OUT/tput128$SFX.json"
        ;;
    tput128-1k)  # 128/128 with 1024 in flight (TensorRT-LLM's max-throughput runs batch >= 1024)
        stage tput128-1k 200 $BENCH throughput $COMMON $VARIANT --input-len 128 --output-len 128 \
            --num-requests 4096 --max-num-seqs 1024 --max-num-batched-tokens 8192 \
            --max-model-len 256 --warmup 384 --output-json "$OUT/tput128_1k$SFX.json"
        ;;
    tput128-eager)  # the same without CUDA graphs: what graphs buy at high batch
        stage tput128-eager 120 $BENCH throughput $COMMON $VARIANT --input-len 128 --output-len 128 \
            --num-requests 1024 --max-num-seqs 512 --max-num-batched-tokens 8192 \
            --max-model-len 256 --warmup 192 --enforce-eager --output-json "$OUT/tput128_eager$SFX.json"
        ;;
    tput1000)  # 1000/1000 max throughput (HF generate would need minutes here: not run)
        stage tput1000 170 $BENCH throughput $COMMON $VARIANT --input-len 1000 --output-len 1000 \
            --num-requests 384 --max-num-seqs 384 --max-num-batched-tokens 8192 \
            --max-model-len 2048 --warmup 24 --output-json "$OUT/tput1000$SFX.json"
        ;;
    tput1000-max)  # 1000/1000 at the most sequences the memory plan holds at 2000 tokens (432)
        stage tput1000-max 170 $BENCH throughput $COMMON $VARIANT --input-len 1000 --output-len 1000 \
            --num-requests 432 --max-num-seqs 432 --max-num-batched-tokens 8192 \
            --max-model-len 2048 --warmup 24 --output-json "$OUT/tput1000_max$SFX.json"
        ;;
    tput1000-3000)  # 1000/1000 as TensorRT-LLM's perf overview runs it: 3000 requests (its
        # figure's count), 768 in flight (what a float8 cache holds at 2000 tokens each)
        stage tput1000-3000 420 $BENCH throughput $COMMON $VARIANT --input-len 1000 \
            --output-len 1000 --num-requests 3000 --max-num-seqs 768 --max-num-batched-tokens 8192 \
            --max-model-len 2048 --warmup 24 --output-json "$OUT/tput1000_3000$SFX.json"
        ;;
    tput1000-3000-16k)  # the same with 16384-token steps: the 400 mixed prefill steps halved
        stage tput1000-3000-16k 420 $BENCH throughput $COMMON $VARIANT --input-len 1000 \
            --output-len 1000 --num-requests 3000 --max-num-seqs 768 --max-num-batched-tokens 16384 \
            --max-model-len 2048 --warmup 24 --output-json "$OUT/tput1000_3000_16k$SFX.json"
        ;;
    tput1000-3000-16k-960)  # ... with 960 in flight: what the memory plan holds at 2000 tokens
        # each at 0.95 of the card (max_num_seqs x max_model_len caps the cache at 768 above)
        stage tput1000-3000-16k-960 420 $BENCH throughput $COMMON $VARIANT --input-len 1000 \
            --output-len 1000 --num-requests 3000 --max-num-seqs 960 --max-num-batched-tokens 16384 \
            --max-model-len 2048 --gpu-memory-utilization 0.95 --warmup 24 \
            --output-json "$OUT/tput1000_3000_16k_960$SFX.json"
        ;;
    tput1000-3000-16k-1000)  # ... with 1000 in flight: the 3000 requests in three whole waves
        # (960 leaves a last wave of 120 decoding alone for ~950 steps); 1000 x 2000 tokens need
        # 122 GiB of float8 cache, 0.985 of the card
        stage tput1000-3000-16k-1000 420 $BENCH throughput $COMMON $VARIANT --input-len 1000 \
            --output-len 1000 --num-requests 3000 --max-num-seqs 1000 \
            --max-num-batched-tokens 16384 --max-model-len 2000 --gpu-memory-utilization 0.985 \
            --warmup 24 --output-json "$OUT/tput1000_3000_16k_1000$SFX.json"
        ;;
    tput1000-768)  # 1000/1000 with 768 in flight: only a float8 cache holds them (2000 tokens each)
        stage tput1000-768 200 $BENCH throughput $COMMON $VARIANT --input-len 1000 --output-len 1000 \
            --num-requests 768 --max-num-seqs 768 --max-num-batched-tokens 8192 \
            --max-model-len 2048 --warmup 24 --output-json "$OUT/tput1000_768$SFX.json"
        ;;
    tput2048)  # 2048/128 max throughput at TensorRT-LLM's request count for it (3000: the
        # 127-step decode tail after the last prefill is ~1% of the run, not 15% as at 256);
        # HF generate on one static batch of 16
        stage tput2048 330 $BENCH throughput $COMMON $VARIANT --input-len 2048 --output-len 128 \
            --num-requests 3000 --max-num-seqs 256 --max-num-batched-tokens 8192 \
            --max-model-len 2176 --warmup 12 $HF_BASELINE --hf-batch-size 16 \
            --output-json "$OUT/tput2048$SFX.json"
        ;;
    tput2048-512seqs)  # the same with 512 in flight: a second wave prefills while the first
        # decodes (at 256 with equal lengths the requests move in waves: 664 pure decode steps)
        stage tput2048-512seqs 330 $BENCH throughput $COMMON $VARIANT --input-len 2048 \
            --output-len 128 --num-requests 3000 --max-num-seqs 512 --max-num-batched-tokens 8192 \
            --max-model-len 2176 --warmup 12 --output-json "$OUT/tput2048_512seqs$SFX.json"
        ;;
    tput2048-16k)  # the same with 16384-token steps: prefill GEMMs twice as tall, half the steps
        stage tput2048-16k 330 $BENCH throughput $COMMON $VARIANT --input-len 2048 \
            --output-len 128 --num-requests 3000 --max-num-seqs 512 --max-num-batched-tokens 16384 \
            --max-model-len 2176 --warmup 12 --output-json "$OUT/tput2048_16k$SFX.json"
        ;;
    tput2048-32k)  # ... and with 32768-token steps (16 prompts a step)
        stage tput2048-32k 330 $BENCH throughput $COMMON $VARIANT --input-len 2048 \
            --output-len 128 --num-requests 3000 --max-num-seqs 512 --max-num-batched-tokens 32768 \
            --max-model-len 2176 --warmup 12 --output-json "$OUT/tput2048_32k$SFX.json"
        ;;
    tput2048-short)  # the same with 256 requests (tput2048 before it took TensorRT-LLM's 3000): one wave and its tail
        stage tput2048-short 170 $BENCH throughput $COMMON $VARIANT --input-len 2048 --output-len 128 \
            --num-requests 256 --max-num-seqs 256 --max-num-batched-tokens 8192 \
            --max-model-len 2176 --warmup 12 --output-json "$OUT/tput2048_short$SFX.json"
        ;;
    prof1)  # kernel-level profile of batch-1 decode steps at 1k context
        stage prof1 120 python3 benchmarks/profile_decode.py --batch 1 --context 1024 \
            $VARIANT --out "$OUT/profile_decode_b1$SFX.txt"
        ;;
    prof512)  # ... and of 512-row decode steps at ~200 context (the 128/128 steady state)
        stage prof512 120 python3 benchmarks/profile_decode.py --batch 512 --context 192 \
            $VARIANT --out "$OUT/profile_decode_b512$SFX.txt"
        ;;
    prof384)  # 384-row decode steps at 1.5k context (the 1000/1000 steady state)
        stage prof384 150 python3 benchmarks/profile_decode.py --batch 384 --context 1500 \
            $VARIANT --out "$OUT/profile_decode_b384_1500$SFX.txt"
        ;;
    prof768)  # ... and 768-row ones (1000/1000 at 3000 requests: 768 in flight over float8 KV)
        stage prof768 200 python3 benchmarks/profile_decode.py --batch 768 --context 1500 \
            $VARIANT --out "$OUT/profile_decode_b768_1500$SFX.txt"
        ;;
    profprefill)  # prefill steps of 8192 tokens: 4 prompts of 2048 (the 2048/128 workload)
        stage profprefill 120 python3 benchmarks/profile_decode.py --prefill --batch 4 \
            --context 2048 --steps 4 $VARIANT --out "$OUT/profile_prefill_4x2048$SFX.txt"
        ;;
    profmixed)  # 2048/128's mixed steps: 4 prompts of 2048 prefilled beside 240 decodes at 2k
        stage profmixed 150 python3 benchmarks/profile_decode.py --prefill --batch 4 \
            --context 2048 --mixed-decodes 240 --steps 4 $VARIANT \
            --out "$OUT/profile_mixed_4x2048_240$SFX.txt"
        ;;
    tput128-sync)  # 128/128 with async scheduling off: what overlapping the host buys
        stage tput128-sync 170 $BENCH throughput $COMMON $VARIANT --input-len 128 --output-len 128 \
            --num-requests 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 \
            --max-model-len 256 --warmup 192 --no-async-scheduling \
            --output-json "$OUT/tput128_sync$SFX.json"
        ;;
    lat1k-sync)
        stage lat1k-sync 90 $BENCH latency $COMMON $VARIANT --input-len 1024 --output-len 128 \
            --num-requests 3 --max-model-len 1280 --no-async-scheduling \
            --output-json "$OUT/lat1k_sync$SFX.json"
        ;;
    lat1k-unfused)  # batch 1 with the fused small-batch linear kernels off: A/B in one run
        KILN_FUSED_LINEAR_MAX_ROWS=0 stage lat1k-unfused 120 $BENCH latency $COMMON $VARIANT \
            --input-len 1024 --output-len 128 --num-requests 3 --max-model-len 1280 \
            --output-json "$OUT/lat1k_unfused$SFX.json"
        ;;
    prof1-unfused)
        KILN_FUSED_LINEAR_MAX_ROWS=0 stage prof1-unfused 120 python3 benchmarks/profile_decode.py \
            --batch 1 --context 1024 --out "$OUT/profile_decode_b1_unfused.txt"
        ;;
    sbl-sweep)  # fused small-batch linear kernels vs the unfused ops, and their tile sweep
        stage sbl-sweep 300 python3 benchmarks/small_batch_linear_sweep.py \
            --out "$OUT/small_batch_linear_sweep.json"
        ;;
    sbl-gate-up)  # the gated gate_up kernel (norm before, SiLU-mul after) at 1/4/8 rows + tiles
        stage sbl-gate-up 150 python3 benchmarks/small_batch_linear_sweep.py --shapes gate_up \
            --rows 1 4 8 --out "$OUT/small_batch_linear_gate_up.json"
        ;;
    fp8-sweep)  # attention kernels over a float8 cache vs bf16; float8 decode tile sweep
        stage fp8-sweep 300 python3 benchmarks/kv_fp8_kernel_sweep.py \
            --out "$OUT/kv_fp8_kernel_sweep.json"
        ;;
    fp8-dots)  # float8 decode attention with float8 tensor-core dots (decode_fp8_kernels.py)
        # against today's widening kernel, every variant's error and PTX; expectations:
        # benchmarks/decode_fp8_dots_expected.md
        stage fp8-dots 420 python3 benchmarks/decode_fp8_dots_sweep.py \
            --out "$OUT/decode_fp8_dots.json"
        ;;
    fp8-widen)  # today's float8 decode kernel with the fp8 -> fp16 widening by cvt, by integer
        # bits, or none (a ceiling): what the conversions cost
        stage fp8-widen 300 python3 benchmarks/decode_fp8_dots_sweep.py --widen-only \
            --out "$OUT/decode_fp8_widen.json"
        ;;
    silu-quant)  # the FP8 MLP's SiLU-mul + float8 quantization: launch shapes (bit-equal), 1-8192
        # rows at d 14336; expectations: benchmarks/silu_quant_expected.md
        stage silu-quant 200 python3 benchmarks/silu_quant_sweep.py --out "$OUT/silu_quant_sweep.json"
        ;;
    fp8-tiles)  # today's float8 decode kernel over 27 tiles (16-64 keys, 1-4 warps, 1-3 stages),
        # cache blocks placed as a fresh engine places them (sequential)
        stage fp8-tiles 300 python3 benchmarks/decode_fp8_dots_sweep.py --today-tiles \
            --placement sequential --out "$OUT/decode_fp8_tiles_sequential.json"
        ;;
    fp8-occupancy)  # today's float8 decode kernel with capped registers, and float8 Q @ K^T on
        # wgmma with fp16 P @ V (benchmarks/decode_fp8_occupancy_expected.md)
        stage fp8-occupancy 300 python3 benchmarks/decode_fp8_occupancy_sweep.py \
            --out "$OUT/decode_fp8_occupancy.json"
        ;;
    scaled-mm)  # the FP8 GEMM's _scaled_mm forms at 512-8192 rows: rowwise (today), tensorwise,
        # each with and without use_fast_accum, against bf16 (benchmarks/scaled_mm_expected.md)
        stage scaled-mm 300 python3 benchmarks/scaled_mm_scaling.py --out "$OUT/scaled_mm_scaling.json"
        ;;
    fp8-linear)  # FP8 W8A8 GEMMs (quantize + _scaled_mm) against bf16, 8B shapes, M=1..8192
        stage fp8-linear 240 python3 benchmarks/fp8_linear_check.py --out "$OUT/fp8_linear.json"
        ;;
    fp8-prefetch)  # float8 decode with V loaded a tile ahead against without, and its tiles
        stage fp8-prefetch 200 python3 benchmarks/kv_fp8_kernel_sweep.py --prefetch-only \
            --out "$OUT/kv_fp8_prefetch.json"
        ;;
    fp8-mixed)  # decode over fp16/float8 K and V in all four combinations: which operand is slow
        stage fp8-mixed 120 python3 benchmarks/kv_fp8_kernel_sweep.py --mixed-only \
            --out "$OUT/kv_fp8_mixed_decode.json"
        ;;
    decode-splits)  # issue 13, startup: decode attention with per-sequence split-K partitions
        # at batch 1/8/64 x context 1k/8k/32k, bf16 and float8 caches, at eager's grid, today's
        # graph grid and one graph per batch size's, against the kernel before (DECODE_BEFORE=FILE,
        # else `git show DECODE_BASE_COMMIT` (default 37597ee) where the tree has history);
        # expectations: benchmarks/decode_splits_expected.md
        before=${DECODE_BEFORE:-/tmp/decode_attention_before.py}
        if [[ -z ${DECODE_BEFORE:-} ]]; then
            git show "${DECODE_BASE_COMMIT:-37597ee}:kiln/kernels/triton/decode_attention.py" \
                >"$before" 2>/dev/null ||
                { echo "decode-splits: no git history: set DECODE_BEFORE for the before"; before=""; }
        fi
        stage decode-splits 240 python3 benchmarks/decode_splits_bench.py \
            ${before:+--before "$before"} --out "$OUT/decode_splits$SFX.json"
        ;;
    # (No stage name may end in a variant's suffix: "prof1-fp8w" would run prof1 as a variant.)
    w8a8-prof1)  # batch-1 decode profile with FP8 W8A8 weights (the fused float8 kernels)
        stage w8a8-prof1 150 python3 benchmarks/profile_decode.py --batch 1 --context 1024 \
            --quantization fp8-dynamic --out "$OUT/profile_decode_b1_fp8w$SFX.txt"
        ;;
    w8a8-tests)  # the FP8 W8A8 kernels at real shapes and the small-batch kernels they share,
        # split-K included (eager, in CUDA graphs, the same bits run to run)
        stage w8a8-tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py \
            tests/test_triton_kernels.py tests/test_split_k_linear.py \
            -k "fp8 or small_batch or add_rms_norm or qkv or split_k"
        ;;
    w8a8-sweep)  # float8 small-batch kernels vs bf16's and the FP8 GEMM path; their launch
        # shapes (split-K 1/2/4/8, tiles, stages), the table entries they suggest
        stage w8a8-sweep 300 python3 benchmarks/fp8_small_batch_sweep.py --budget-s 200 \
            --out "$OUT/fp8_small_batch_sweep$SFX.json"
        ;;
    w8a8-sweep-wide)  # issue 13, batch 1: gate_up and down at one row over what w8a8-sweep
        # never tries (8 warps, 2-6 stages, 64-wide K steps, 128-row tiles); A/B its suggestions
        # with SWEPT_TILES=$OUT/fp8_small_batch_sweep_wide.json w8a8-lat1k-swept
        stage w8a8-sweep-wide 450 python3 benchmarks/fp8_small_batch_sweep.py --wide --rows 1 \
            --shapes gate_up down --splits 1 2 4 --budget-s 360 \
            --out "$OUT/fp8_small_batch_sweep_wide$SFX.json"
        ;;
    w8a8-sweep-head)  # the float8 LM head's one-row kernel (128256 x 4096, no table entry yet)
        stage w8a8-sweep-head 200 python3 benchmarks/fp8_small_batch_sweep.py --rows 1 \
            --shapes lm_head --budget-s 120 --out "$OUT/fp8_small_batch_sweep_head$SFX.json"
        ;;
    fp8-epilogue)  # issue 13: the MLP activation before down_proj (bf16 SiLU-mul + quantize vs
        # the float8 SiLU-mul), o_proj's quantize, and rowwise vs tensorwise _scaled_mm at 512
        # decode rows and an 8192-token prefill chunk
        stage fp8-epilogue 240 python3 benchmarks/fp8_epilogue_bench.py --rows 512 8192 \
            --out "$OUT/fp8_epilogue$SFX.json"
        ;;
    w8a8-lat1k-swept | w8a8-prof1-swept)  # lat1k-fp8w / w8a8-prof1 with the shapes w8a8-sweep
        # suggested (its JSON in this run's $OUT, or SWEPT_TILES=FILE), before they are written
        # into small_batch_tiles.MEASURED_TILES: the end-to-end A/B in the same run
        swept=${SWEPT_TILES:-$OUT/fp8_small_batch_sweep.json}
        if [[ $s == w8a8-lat1k-swept ]]; then
            KILN_SMALL_BATCH_TILES=$swept stage w8a8-lat1k-swept 150 $BENCH latency $COMMON \
                --quantization fp8-dynamic --input-len 1024 --output-len 128 --num-requests 3 \
                --max-model-len 1280 --output-json "$OUT/lat1k_fp8w_swept$SFX.json"
        else
            KILN_SMALL_BATCH_TILES=$swept stage w8a8-prof1-swept 150 python3 \
                benchmarks/profile_decode.py --batch 1 --context 1024 --quantization fp8-dynamic \
                --out "$OUT/profile_decode_b1_fp8w_swept$SFX.txt"
        fi
        ;;
    build8b)  # kiln build of an 8B dummy HF checkpoint to FP8, then cold first token from it:
        # first and second process of the older loader (KILN_BASE_COMMIT, default 5c1028b: before
        # issue 13's startup work; 6143508: before the startup2 branch) and of this tree, with
        # and without the engine's carried Triton kernels and the shards hashed beside torch's
        # import (KILN_ENGINE_PREHASH), each first process on an empty Triton cache
        # (expectations: benchmarks/startup_expected.md, benchmarks/startup2_expected.md)
        BASE_TREE=${KILN_BASE_TREE:-/tmp/kiln_startup_base_tree}
        BASE_ARG=()
        if [[ -z ${KILN_BASE_TREE:-} ]]; then
            rm -rf "$BASE_TREE" && mkdir -p "$BASE_TREE"
            git archive "${KILN_BASE_COMMIT:-5c1028b}" kiln | tar -x -C "$BASE_TREE" ||
                { echo "build8b: no git history here: set KILN_BASE_TREE for the before"; BASE_TREE=""; }
        fi
        [[ -n $BASE_TREE ]] && BASE_ARG=(--base-tree "$BASE_TREE")
        stage build8b 500 python3 benchmarks/build_and_first_token.py --preset llama-3.1-8b \
            --work "${WORK:-/tmp/kiln-build8b}" --quantization fp8-dynamic "${BASE_ARG[@]}" \
            --output-json "$OUT/build_first_token_8b$SFX.json"
        ;;
    prequant)  # issue 13: kiln build from pre-quantized FP8 checkpoints on the GPU: the
        # llm-compressor / ModelOpt test checkpoints (accuracy check vs the checkpoint loaded
        # directly, the kernel tiles recorded for this GPU), and build time of an 8B-shaped
        # compressed-tensors checkpoint (expectations: benchmarks/prequant_build_expected.md)
        stage prequant 580 python3 benchmarks/prequant_build_gpu.py \
            --work "${WORK:-/tmp/kiln-prequant}" --output-json "$OUT/prequant_build$SFX.json"
        ;;
    so-json)  # issue 18: 64 concurrent 128/128 JSON-schema requests vs the same unconstrained
        # (5 alternating rounds each after a warm-up of each at the same 64 rows, one process);
        # needs xgrammar (pip install xgrammar)
        stage so-json 600 python3 benchmarks/structured_output_bench.py --model llama-3.1-8b \
            --load-format dummy --dtype bfloat16 --num-requests 64 --input-len 128 \
            --output-len 128 --rounds 5 --out "$OUT/structured_output$SFX.json"
        ;;
    so-mask-host)  # issue 18: the grammar mask's host cost at 64 rows on this host's CPUs, old
        # way vs new, over 1/4/8/12 fill threads (no GPU; the thread scaling so-json depends on)
        for t in 1 4 8 12; do
            stage so-mask-host-t$t 120 python3 benchmarks/grammar_mask_cpu.py --rows 64 \
                --steps 24 --fill-threads $t --engine-work-ms 3 --out "$OUT/grammar_mask_t$t$SFX.json"
        done
        ;;
    test-so)  # issue 18: the structured-output tests on CUDA (async scheduling on, graphs)
        stage test-so 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_structured_output.py
        ;;
    beam4)  # issue 18: beam width 4 at batch 1 vs a plain batch-4 decode step, and HF's beams
        # (expectations: benchmarks/beam_search_expected.md)
        stage beam4 400 python3 benchmarks/beam_search_bench.py --model llama-3.1-8b \
            --load-format dummy --dtype bfloat16 --width 4 --input-len 128 --output-len 64 \
            --repeats 3 --cprofile 30 ${NO_HF:+--no-hf} --out "$OUT/beam_search$SFX.json"
        ;;
    beam4ab)  # beam4 before the copy-on-write forks (KILN_BASE_COMMIT, default 6451c35), then
        # now, in one run; each pass ~3-6 min: BEAM_PASSES=before and =forks as two commands fit
        # a 10-min limit
        BASE_TREE=${KILN_BASE_TREE:-/tmp/kiln_beam_base_tree}
        for pass in ${BEAM_PASSES:-before forks}; do
            if [[ $pass == before ]]; then
                if [[ -z ${KILN_BASE_TREE:-} ]]; then
                    rm -rf "$BASE_TREE" && mkdir -p "$BASE_TREE"
                    if ! git archive "${KILN_BASE_COMMIT:-6451c35}" kiln | tar -x -C "$BASE_TREE"; then
                        echo "beam4ab: no git history here: set KILN_BASE_TREE to a copy of the old tree"
                        continue
                    fi
                fi
                KILN_TREE=$BASE_TREE TAG=before NO_HF=1 OUT=$OUT bash "$0" beam4
            else
                KILN_TREE=. TAG=forks OUT=$OUT bash "$0" beam4
            fi
        done
        ;;
    # ---- tensor/pipeline parallel (issue 17; docs/parallelism.md). NVLink multicast stays off
    # (the lent machines' rule): the variables are set again here, where the ranks inherit them.
    tp1-check)  # one H200: batch 1 and 128/128 before and after the parallel layers, one run
        BASE_TREE=${KILN_BASE_TREE:-/tmp/kiln_base_tree}
        if [[ -z ${KILN_BASE_TREE:-} ]]; then
            rm -rf "$BASE_TREE" && mkdir -p "$BASE_TREE"
            if ! git archive "${KILN_BASE_COMMIT:-2f5976f}" kiln | tar -x -C "$BASE_TREE"; then
                echo "tp1-check: no git history here: set KILN_BASE_TREE to a copy of the old tree"
                continue
            fi
        fi
        # base, parallel, base, parallel: drift shows as a pass difference. Each pass is ~6-7 min
        # (lat1k + tput128, twice): PASSES=1 and PASSES=2 as two commands fit a 10-min limit.
        for pass in ${PASSES:-1 2}; do
            KILN_TREE=$BASE_TREE TAG=base$pass NO_HF=1 OUT=$OUT bash "$0" lat1k tput128
            KILN_TREE=. TAG=tp1_$pass NO_HF=1 OUT=$OUT bash "$0" lat1k tput128
        done
        ;;
    test-parallel-gpu)  # 2 GPUs: the CPU suite's parallel tests on CUDA with NCCL
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            KILN_PARALLEL_TEST_DEVICE=cuda stage test-parallel-gpu 400 \
            python3 -m pytest -q -x -p no:cacheprovider tests/test_parallel.py
        ;;
    tp8b-2 | pp8b-2)  # 2 GPUs: Llama-3.1-8B bf16, batch 1 and 128/128 at TP=2 or PP=2
        PAR="--tensor-parallel-size 2" && [[ $s == pp8b-2 ]] && PAR="--pipeline-parallel-size 2"
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            stage "${s}_lat1k" 300 $BENCH latency $COMMON $VARIANT $PAR --input-len 1024 \
            --output-len 128 --num-requests 3 --max-model-len 1280 \
            --output-json "$OUT/${s}_lat1k$SFX.json"
        # TP=2 captures its decode graphs with the NCCL all-reduces inside: the eager run
        # beside it is their A/B (PP=2 stages run eager either way).
        [[ $s == tp8b-2 ]] && NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
            NVSHMEM_DISABLE_NVLS=1 stage "${s}_lat1k_eager" 300 $BENCH latency $COMMON $VARIANT \
            $PAR --input-len 1024 --output-len 128 --num-requests 3 --max-model-len 1280 \
            --enforce-eager --output-json "$OUT/${s}_lat1k_eager$SFX.json"
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            stage "${s}_tput128" 400 $BENCH throughput $COMMON $VARIANT $PAR --input-len 128 \
            --output-len 128 --num-requests 2048 --max-num-seqs 512 \
            --max-num-batched-tokens 8192 --max-model-len 256 --warmup 192 \
            --output-json "$OUT/${s}_tput128$SFX.json"
        ;;
    tp70b-1 | tp70b-2 | tp70b-4 | tp70b-8)  # 1/2/4/8 GPUs: 70B FP8 128/128 (TRT-LLM's table)
        N=${s#tp70b-}
        NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
            stage "$s" 600 $BENCH throughput --model llama-3.1-70b --load-format dummy \
            --dtype bfloat16 --no-progress --quantization fp8-dynamic --tensor-parallel-size "$N" \
            --input-len 128 --output-len 128 --num-requests 2048 --max-num-seqs 512 \
            --max-num-batched-tokens 8192 --max-model-len 256 --warmup 192 \
            --output-json "$OUT/tput128_70b_fp8_tp$N$SFX.json"
        ;;
    serve128 | serve1000-lo | serve1000-256 | serve1000-512)
        # Issue 15: kiln serve (engine process; SERVE_FLAGS=--no-engine-process for the A/B)
        # beside the offline engine in the same run, streaming and not, 2 requests per slot
        # (1000/1000: 1), the client checked by one more process from concurrency 256 on.
        # Expectations: benchmarks/serve_vs_offline_expected.md.
        ENGINE="--model llama-3.1-8b --load-format dummy --dtype bfloat16 $VARIANT"
        SVO="python3 benchmarks/serve_vs_offline.py --check-client-from 256 --min-requests 8"
        case $s in
        serve128) stage serve128 560 $SVO --out "$OUT/serve128$SFX" --shapes 128x128 \
            --concurrency 1 64 256 512 --requests-per-concurrency 2 -- $ENGINE ;;
        serve1000-lo) stage serve1000-lo 560 $SVO --out "$OUT/serve1000_lo$SFX" \
            --shapes 1000x1000 --concurrency 1 64 --requests-per-concurrency 1 -- $ENGINE ;;
        serve1000-256) stage serve1000-256 560 $SVO --out "$OUT/serve1000_256$SFX" \
            --shapes 1000x1000 --concurrency 256 --requests-per-concurrency 1 -- $ENGINE ;;
        serve1000-512) stage serve1000-512 580 $SVO --out "$OUT/serve1000_512$SFX" \
            --shapes 1000x1000 --concurrency 512 --requests-per-concurrency 1 -- $ENGINE ;;
        esac
        ;;
    serve-api128 | serve-api1000)
        # kiln serve with one API process against two (--api-server-count 2), beside the
        # offline engine in the same run, at concurrency 256 and 512. 128/128: 4 requests per
        # slot (ramp and tail a small part of the run), streaming and not, the client checked
        # at 512; 1000/1000: 1 per slot, streaming only (the time limit). Expectations:
        # benchmarks/serve_api_servers_expected.md.
        ENGINE="--model llama-3.1-8b --load-format dummy --dtype bfloat16 $VARIANT"
        SVO="python3 benchmarks/serve_vs_offline.py --min-requests 8 --concurrency 256 512"
        case $s in
        serve-api128) stage serve-api128 230 $SVO --out "$OUT/serve_api128$SFX" \
            --shapes 128x128 --requests-per-concurrency 4 --check-client-from 512 \
            --serve-variants "" "--api-server-count 2" -- $ENGINE ;;
        serve-api1000) stage serve-api1000 310 $SVO --out "$OUT/serve_api1000$SFX" \
            --shapes 1000x1000 --requests-per-concurrency 1 --modes stream \
            --serve-variants "" "--api-server-count 2" -- $ENGINE ;;
        esac
        ;;
    serve-c512)  # 128/128 and 1000/1000 at concurrency 512 against an offline engine with the
        # same --max-num-seqs 512 (serve_vs_offline.py gave it its default of 256 before, so the
        # earlier 105-107% at 512 compared with a smaller engine); one API process
        ENGINE="--model llama-3.1-8b --load-format dummy --dtype bfloat16 $VARIANT"
        SVO="python3 benchmarks/serve_vs_offline.py --min-requests 8 --concurrency 512"
        stage serve-c512-128 200 $SVO --out "$OUT/serve_c512_128$SFX" --shapes 128x128 \
            --requests-per-concurrency 4 -- $ENGINE
        stage serve-c512-1000 280 $SVO --out "$OUT/serve_c512_1000$SFX" --shapes 1000x1000 \
            --requests-per-concurrency 1 --modes stream -- $ENGINE
        ;;
    serve1000-nostream)  # 1000/1000 non-streaming at concurrency 256 against the offline engine
        ENGINE="--model llama-3.1-8b --load-format dummy --dtype bfloat16 $VARIANT"
        stage serve1000-nostream 240 python3 benchmarks/serve_vs_offline.py --min-requests 8 \
            --concurrency 256 --out "$OUT/serve1000_nostream$SFX" --shapes 1000x1000 \
            --requests-per-concurrency 1 --modes no-stream -- $ENGINE
        ;;
    spec)  # speculative decoding at batch 1 (and 4, 16, 32): verification step cost with K=4
        # vs a plain decode step, tok/s at mean acceptance lengths 2, 3, 4 (the oracle accepting
        # by its own draw), a random EAGLE-3 head's cost per step at 8B shapes; each engine in a
        # process of its own (plain, spec with async scheduling, spec-sync: batch 1 with it off,
        # eagle3; SPEC_PHASES="plain spec" runs only those; SPEC_BATCHES="1 64 128 256" the
        # batch sizes of the oracle and plain rows: the crossover); expectations:
        # benchmarks/spec_decode_gpu_expected.md
        stage spec 560 python3 benchmarks/spec_decode_gpu.py --model llama-3.1-8b \
            --load-format dummy --dtype bfloat16 ${SPEC_PHASES:+--phases $SPEC_PHASES} \
            ${SPEC_BATCHES:+--batches $SPEC_BATCHES} \
            --out "$OUT/spec_decode_gpu$SFX.json"
        ;;
    decode-packed)  # float8 decode attention: decode_attention_packed's kernel (sub-partitions
        # in tl.dot's padded rows) over its tiles against today's, six shapes; expectations:
        # benchmarks/decode_packed_expected.md
        stage decode-packed 300 python3 benchmarks/decode_packed_sweep.py \
            --out "$OUT/decode_packed$SFX.json"
        ;;
    decode-waves)  # float8 decode attention at 640-1088 rows x 1k-2k, 1-3 splits, then rows
        # every 32 beside grids padded to multiples of 128: the waves of 132 rows
        stage decode-waves 200 python3 benchmarks/decode_waves_sweep.py \
            --out "$OUT/decode_waves$SFX.json"
        stage decode-waves-padding 200 python3 benchmarks/decode_waves_sweep.py --padding \
            --out "$OUT/decode_waves_padding$SFX.json"
        ;;
    decode-occupancy)  # the packed float8 decode kernel's programs an SM: its one-warp tile as
        # the rule picks it, capped at 168 / 160 registers, with the carveout at its maximum, one
        # stage capped at 168 / 128; 768-1088 rows x 1.5k / 2k, the driver's occupancy of each
        stage decode-occupancy 240 python3 benchmarks/decode_waves_sweep.py --occupancy \
            --out "$OUT/decode_occupancy$SFX.json"
        ;;
    decode-stream-k)  # float8 decode attention's stream-K schedule against the packed grid: the
        # decode tests on the GPU (stream-K's at 8B shapes) and the KV cache layouts', then one
        # layer at 256-1088 rows x 192-2000 keys, equal and mixed lengths, over token- and
        # head-major blocks (benchmarks/decode_stream_k_expected.md)
        stage stream-k-tests 300 python3 -m pytest -q -x -p no:cacheprovider \
            tests/test_triton_kernels.py tests/test_kv_cache_layout.py \
            -k "decode_attention or kv_cache_layout"
        stage decode-stream-k 300 python3 benchmarks/decode_stream_k_sweep.py \
            --out "$OUT/decode_stream_k$SFX.json"
        ;;
    decode-gap)  # float8 decode attention alone vs as the engine's step runs it: 32 layers'
        # caches, engine-sized pools, a layer's projections between calls, grown contexts
        # (512 x 192, 384 x 1.5k, 768 x 1.5k)
        stage decode-gap 420 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
            python3 benchmarks/decode_in_engine_gap.py ${GAP_SHAPES:+--shapes $GAP_SHAPES} \
            --out "$OUT/decode_in_engine_gap$SFX.json"
        ;;
    outlier-cost)  # outlier columns on the GPU: their tests (Triton ops, a CUDA graph), then
        # static fp8's attention and MLP blocks with and without them at 8B shapes, 1-8192 rows
        stage outlier-tests 200 python3 -m pytest -q -x -p no:cacheprovider \
            tests/test_outlier_columns.py -k "triton_ops or projection or remainder"
        stage small-batch-fp8-tests 200 python3 -m pytest -q -x -p no:cacheprovider \
            tests/test_fp8_linear.py -k "small_batch_fp8 or llama8b_shapes"
        stage outlier-cost 300 python3 benchmarks/outlier_columns_cost.py \
            --out "$OUT/outlier_columns_cost$SFX.json"
        ;;
    outlier-e2e)  # static fp8 8B engines (dummy weights, README as calibration text) built
        # with and without 16 outlier columns, then 128/128, 1000/1000 and batch 1 on each
        stage outlier-e2e "${E2E_LIMIT:-560}" python3 benchmarks/outlier_columns_e2e.py \
            --work "${WORK:-/tmp/kiln-outlier-e2e}" --out "$OUT/outlier_e2e$SFX.json" \
            --workloads ${E2E_WORKLOADS:-lat1k tput128 tput1000}
        ;;
    one-row-cost)  # where a one-row float8 projection's time goes: the split-K hand-off,
        # the launch floor, HBM against L2 (o_proj and down, the measured tiles)
        stage one-row-cost 240 python3 benchmarks/one_row_fixed_cost.py \
            --out "$OUT/one_row_fixed_cost$SFX.json"
        ;;
    gemm-k)  # the float8 GEMM at K + 16..128 against K, and the unfused outlier-column pieces
        stage gemm-k 240 python3 benchmarks/fp8_gemm_k_alignment.py --out "$OUT/gemm_k$SFX.json"
        ;;
    test-spec)  # the speculative-decoding tests on the GPU machine (Triton kernels, real graphs)
        # (test_gpu's speculative test: every method on CUDA, async scheduling on by default)
        stage test-spec 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_spec_decode.py \
            tests/test_gpu.py -k "spec or speculative"
        ;;
    *)
        echo "unknown stage $s"
        ;;
    esac
done
echo "=== done ($(date +%T))"
