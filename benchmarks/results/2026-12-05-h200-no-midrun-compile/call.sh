#!/usr/bin/env bash
# 1000/1000 at TensorRT-LLM's 3000 requests (static fp8 + float8 KV, 1000 in flight, 16k-token
# steps), each side from an empty Triton cache so that each compiles what it needs itself: the
# tree before the fix (d26abb7, extracted to ab_old/ and run through KILN_TREE) and this one, on
# one warm H200: this tree first (the device time left may not cover both).
# Expected: README.md, written before the run.
set -u
python3 -m pip install -q --no-deps --no-index .whl/*.whl 2>&1 | tail -1
export PYTHONUNBUFFERED=1 DMON=1 NO_HF=1 OUT=$OUT
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
TRITON_CACHE_DIR=$(mktemp -d) TAG=new \
    bash benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8 2>&1 | grep -v "^WARNING" | tail -3
TRITON_CACHE_DIR=$(mktemp -d) KILN_TREE=ab_old TAG=old \
    bash benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8 2>&1 | grep -v "^WARNING" | tail -3
for f in $OUT/tput1000_3000_16k_1000_*.json; do
    python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
k, st = d["kiln"], d["step_trace"]
rows = [dict(zip(st["columns"], r)) for r in st["rows"]]
stalls = [(i, r["num_seqs"], r["num_tokens"], round(r["forward_launch"])) for i, r in enumerate(rows) if r["forward_launch"] > 150]
print(sys.argv[1].rsplit("/", 1)[1], round(k["output_tok_s"], 1), round(k["duration_s"], 2), k["tpot"]["p50_ms"], d["env"]["git_revision"])
print("  steps with forward_launch > 150 ms:", stalls)
print("  kernel_compiles:", json.dumps(d.get("kernel_compiles"))[:1500])
PY
done
