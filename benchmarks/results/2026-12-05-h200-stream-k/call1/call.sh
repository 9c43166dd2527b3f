#!/usr/bin/env bash
# Call 1: the stream-K / natural-loop / head-major GPU tests, then the one-layer sweep
# (benchmarks/decode_stream_k_expected.md has what was expected before it ran).
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py \
    tests/test_kv_cache_layout.py -k "decode_attention or kv_cache_layout" > $OUT/tests.txt 2>&1
echo "tests exit $?"; tail -3 $OUT/tests.txt
PYTHONPATH=benchmarks:. timeout 330 python3 benchmarks/decode_stream_k_sweep.py \
    --out $OUT/decode_stream_k.json > $OUT/sweep.txt 2>&1
echo "sweep exit $?"; cut -c1-400 $OUT/sweep.txt | tail -40
