#!/usr/bin/env bash
# Call 2 (after call 1's +3.2% at batch 1 on an H100): the rest of the float8 small-batch GPU
# tests (call 1 stopped at a fixture the device lacks), more tiles for the swapped dot (8 warps,
# 256-row tiles, 2 stages), then batch 1 end to end twice each way, alternated: the plain dot,
# the swapped dot with the A/B's fastest tiles.
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_linear.py \
    tests/test_split_k_linear.py tests/test_kernel_variants.py -k "not smollm2" 2>&1 | tail -4 \
    | tee "$OUT/tests.txt"
PYTHONPATH=. timeout 200 python3 benchmarks/small_batch_swap_ab.py --rows 1 \
    --out "$OUT/swap_ab.json" --tiles-out "$OUT/swap_tiles.json" > "$OUT/swap_ab.txt" 2>&1
grep -v "^suggested" "$OUT/swap_ab.txt" | grep -v " s$" | tail -50; grep "^suggested" "$OUT/swap_ab.txt"
for pass in 1 2; do
    KILN_SMALL_BATCH_SWAP_AB=0 TAG=swap0_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    KILN_SMALL_BATCH_TILES=$OUT/swap_tiles.json TAG=swap1tiles_$pass \
        bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
done
for f in "$OUT"/lat1k*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); k=d['kiln']; \
print(sys.argv[1].rsplit('/',1)[1], round(k['output_tok_s'],1), round(k.get('decode_tok_s',0),1), \
d.get('kernel_compiles'))" "$f"
done
