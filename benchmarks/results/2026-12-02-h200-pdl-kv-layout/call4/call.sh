#!/usr/bin/env bash
# Call 4: decode attention over token-major (the engine's) against head-major KV blocks, block
# sizes 16 and 64, float8 and bf16 caches, Llama-3.1-8B shapes, one layer (the kernel reads a
# head-major permuted view: decode_attention._head_major; outputs checked bit-equal).
set -u
PYTHONPATH=. timeout 330 python3 benchmarks/decode_kv_layout_sweep.py --budget-s 200 \
    --out $OUT/decode_kv_layout.json 2>&1 | tail -60
