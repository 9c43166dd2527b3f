#!/usr/bin/env bash
# Call 1: the GPU tests of the float8 small-batch kernels (both dots), the per-projection A/B
# (benchmarks/small_batch_swap_ab.py), then batch 1 end to end three ways: the plain dot
# (KILN_SMALL_BATCH_SWAP_AB=0, the tree before), the swapped dot at the table's tiles, and the
# swapped dot with the A/B's fastest tiles (KILN_SMALL_BATCH_TILES).
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_fp8_linear.py \
    tests/test_split_k_linear.py tests/test_kernel_variants.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
PYTHONPATH=. timeout 240 python3 benchmarks/small_batch_swap_ab.py --out "$OUT/swap_ab.json" \
    --tiles-out "$OUT/swap_tiles.json" > "$OUT/swap_ab.txt" 2>&1
grep -v "^suggested" "$OUT/swap_ab.txt" | grep -v " s$" | tail -70; grep "^suggested" "$OUT/swap_ab.txt"
KILN_SMALL_BATCH_SWAP_AB=0 TAG=swap0 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "^==="
TAG=swap1 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "^==="
if [[ -s $OUT/swap_tiles.json ]]; then
    KILN_SMALL_BATCH_TILES=$OUT/swap_tiles.json TAG=swap1tiles \
        bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "^==="
fi
for f in "$OUT"/lat1k*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); k=d['kiln']; \
print(sys.argv[1].rsplit('/',1)[1], round(k['output_tok_s'],1), round(k.get('decode_tok_s',0),1), \
d.get('kernel_compiles'))" "$f"
done
