#!/usr/bin/env bash
# Call 3: 1000/1000 at 3000 requests, 1000 in flight, 16k-token steps, static fp8 + float8 KV:
# the default engine (head-major KV blocks since call 1), then the same with SWITCHES (e.g.
# "KILN_KV_CACHE_LAYOUT=token", the layout A/B on the H200), on one warm machine, one after the
# other. Needs an H200's memory (1000 x 2000 tokens of float8 cache: 0.985 of its 141 GB).
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 DMON=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
TAG=base bash benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8 2>&1 | grep -v "^WARNING" | tail -4
env ${SWITCHES:?} TAG=sk bash benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8 2>&1 \
    | grep -v "^WARNING" | tail -4
for f in $OUT/tput1000_3000_16k_1000_*.json; do
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); k=d['kiln']; \
print(sys.argv[1].rsplit('/',1)[1], round(k['output_tok_s'],1), k['tpot']['p50_ms'], \
d['env'].get('kiln_env'))" "$f"
done
