#!/usr/bin/env bash
# Call 1: batch 1 on the H200 at HEAD against the tree before the round-trip cuts (1899ce9, in
# .scratch/base), the one-row tiles re-timed on this card and tried end to end, and bf16 batch 1.
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
PYTHONPATH=benchmarks:. timeout 240 python3 benchmarks/small_batch_swap_ab.py --rows 1 \
    --out "$OUT/swap_ab.json" --tiles-out "$OUT/tiles_h200.json" > "$OUT/swap_ab.txt" 2>&1
grep -v " s$" "$OUT/swap_ab.txt" | tail -60
for pass in 1 2; do
    KILN_TREE=.scratch/base TAG=base_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    TAG=head_$pass bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    if [[ -s $OUT/tiles_h200.json ]]; then
        KILN_SMALL_BATCH_TILES=$OUT/tiles_h200.json TAG=tiles_$pass \
            bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
    fi
done
TAG=bf16 bash benchmarks/h200_run.sh lat1k 2>&1 | grep "exit"
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
