#!/usr/bin/env bash
# Call 2: the one-kernel FP8 MLP block at batch 1 (kernels/triton/mlp_one_row.py): its GPU
# tests, the tile sweep against the engine's two kernels (benchmarks/mlp_one_row_expected.md has
# what was expected before it ran), then batch-1 decode at 1k end to end (static fp8, float8 KV
# and LM head): plain, the switch at the default tiles, the switch at the sweep's best (when it
# differs), plain again while the call's 600 s last.
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_mlp_one_row.py \
    tests/test_split_k_linear.py > $OUT/mlp_tests.txt 2>&1
echo "tests exit $? at ${SECONDS}s"; tail -3 $OUT/mlp_tests.txt
PYTHONPATH=benchmarks:. timeout 200 python3 benchmarks/mlp_one_row_sweep.py \
    --out $OUT/mlp_one_row.json > $OUT/mlp_sweep.txt 2>&1
echo "sweep exit $? at ${SECONDS}s"; tail -1 $OUT/mlp_sweep.txt | cut -c1-1500
BEST=$(python3 -c "import json; t=json.load(open('$OUT/mlp_one_row.json'))['summary']['best_fused']['tiles']; \
print(','.join(str(t[k]) for k in ('block_c','block_k','block_h','num_warps','num_stages','stats_block')))" 2>/dev/null)
echo "best tiles: ${BEST:-none}"
export NO_HF=1 OUT=$OUT
TAG=plain bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "^==="
KILN_MLP_ONE_KERNEL=1 TAG=one bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "^==="
if [[ -n $BEST && $BEST != 64,256,128,4,3,1024 && $SECONDS -lt 510 ]]; then
    KILN_MLP_ONE_KERNEL=1 KILN_MLP_ONE_KERNEL_TILES=$BEST TAG=one_best \
        bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "^==="
fi
[[ $SECONDS -lt 530 ]] && TAG=plain2 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "^==="
for f in $OUT/lat1k_*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); k=d['kiln']; \
print(sys.argv[1].rsplit('/',1)[1], {x: k[x] for x in k if 'tok_s' in x}, d['env'].get('kiln_env'))" "$f"
done
