#!/usr/bin/env bash
# Call 3: on an H200, static fp8 batch 1 both ways first (the issue-13 row on its own card, twice,
# alternated); then the same swap for bf16 weights (KILN_SMALL_BATCH_SWAP_AB_16BIT, off by
# default): the per-projection A/B with bf16 weights, batch 1 bf16 end to end both ways (the A/B's
# tiles for the swapped side), and last the GPU tests of the small-batch kernels with it.
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$GPU"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
summary() {
    for f in "$OUT"/lat1k*.json; do
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); k=d['kiln']; \
print(sys.argv[1].rsplit('/',1)[1], round(k['output_tok_s'],1), round(k.get('decode_tok_s',0),1), \
d.get('kernel_compiles'))" "$f"
    done
}
if [[ $GPU == *H200* ]]; then
    for pass in 1 2; do
        KILN_SMALL_BATCH_SWAP_AB=0 TAG=swap0_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
        TAG=swap1_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    done
    summary
fi
PYTHONPATH=. timeout 120 python3 benchmarks/small_batch_swap_ab.py --bf16 \
    --out "$OUT/swap_ab_bf16.json" --tiles-out "$OUT/swap_tiles_bf16.json" > "$OUT/swap_ab_bf16.txt" 2>&1
grep -v " s$" "$OUT/swap_ab_bf16.txt" | tail -30
TAG=bf16_swap0 bash benchmarks/h200_run.sh lat1k 2>&1 | grep "exit"
KILN_SMALL_BATCH_SWAP_AB_16BIT=1 KILN_SMALL_BATCH_TILES=$OUT/swap_tiles_bf16.json \
    TAG=bf16_swap1tiles bash benchmarks/h200_run.sh lat1k 2>&1 | grep "exit"
summary
KILN_SMALL_BATCH_SWAP_AB_16BIT=1 timeout 100 python3 -m pytest -q -p no:cacheprovider \
    tests/test_triton_kernels.py -k "linear or qkv" 2>&1 | tail -3 | tee "$OUT/tests.txt"
