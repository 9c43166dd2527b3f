#!/usr/bin/env bash
# The float8 decode kernel at 512 x 192 inside the engine's 512-row decode step (prof512-w8kv8:
# an earlier profile read 119 us a layer) against the same kernel alone on a compact cache
# (84.9 us in the fourth run's sweep), same process tree, same machine; then 384 x 1.5k.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
OUT=$R bash benchmarks/h200_run.sh prof512-w8kv8 2>&1 | grep -E "===|rror"
PYTHONPATH=.:benchmarks timeout 120 python3 - <<'PY' 2>&1 | tee $R/micro.txt
import torch
from decode_fp8_dots_sweep import inputs, PLACEMENT, HEAD_DIM
from tile_sweep import graph_time_ms
from kiln.kernels.triton import decode_attention as da
for placement in ("sequential", "random"):
    PLACEMENT["mode"] = placement
    for batch, context in ((512, 192), (384, 1500)):
        q, k, v, table, lens = inputs(batch, context)
        call = lambda: da.paged_decode_attention(q, k, v, table, lens, HEAD_DIM**-0.5, context)
        us = graph_time_ms([call], reps=20, replays=3) * 1e3
        print(f"{placement} {batch}x{context}: {us:.1f} us")
PY
head -14 $R/profile_decode_b512_fp8w_fp8kv.txt
cd $R && tar czf $OUT/call.tgz . && cd - >/dev/null && rm -rf $R
