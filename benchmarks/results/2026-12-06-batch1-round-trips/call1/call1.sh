#!/usr/bin/env bash
# Call 1: GPU tests of the changed kernels, the weight-layout bench, batch 1 A/B (pass 1).
set -u
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_split_k_linear.py tests/test_fp8_linear.py \
    -k "decode or qkv or small_batch or split or fp8" > "$OUT/tests.txt" 2>&1
tail -2 "$OUT/tests.txt"
PYTHONPATH=benchmarks:. timeout 170 python3 benchmarks/weight_layout_bench.py \
    --out "$OUT/layout.json" > "$OUT/layout.txt" 2>&1
python3 - "$OUT/layout.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(f"{r['shape']:8s} {r['tiles_label']:9s} {r['layout']:6s} {r['us']:7.2f} us "
          f"{r['tb_s']:.2f} TB/s eq={r['equal_bits']}")
PY
KILN_TREE=.scratch/base TAG=base_1 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
TAG=new_1 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
KILN_SMALL_BATCH_PREFETCH_STEPS=2 TAG=pf2_1 bash benchmarks/h200_run.sh lat1k-s8kv8h8 2>&1 | grep "exit"
python3 benchmarks/bench_summary.py "$OUT"/lat1k*.json
