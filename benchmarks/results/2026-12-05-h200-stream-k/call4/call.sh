#!/usr/bin/env bash
# Call 4 (after call 3, on the same warm H200): the issue-13 target rows other than 1000/1000
# again with head-major KV blocks, the default since 2026-12-05 (an H100 showed them unchanged:
# ../layout-ab-h100/). Batch 1 (static fp8, float8 KV and LM head), 128/128 (fp8-dynamic +
# float8 KV, its best row) and 2048/128 at TensorRT-LLM's 3000 requests (static fp8 + float8 KV).
# Expected: within each row's lease-to-lease spread (3-6%) of docs/performance.md's table.
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for stage in lat1k-s8kv8h8 tput128-w8kv8 tput2048-s8kv8; do
    bash benchmarks/h200_run.sh $stage 2>&1 | grep "^==="
done
for f in $OUT/*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); k=d['kiln']; \
print(sys.argv[1].rsplit('/',1)[1], round(k['output_tok_s'],1), round(k.get('decode_tok_s',0),1), \
d['env'].get('kiln_env'))" "$f"
done
