#!/usr/bin/env bash
# Call 5 (after call 4, same warm H200): 2048/128 at 3000 requests, token-major then head-major
# KV blocks, one process each (call 4's 3,507 was under the table's 3,561-3,585).
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NO_HF=1
mkdir -p $OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for i in 1 2; do
    if [ $i = 1 ]; then SW="KILN_KV_CACHE_LAYOUT=token"; else SW="KILN_KV_CACHE_LAYOUT=head"; fi
    env $SW TAG=$i bash benchmarks/h200_run.sh tput2048-s8kv8 2>&1 | grep "^==="
done
