#!/usr/bin/env bash
# Call 2: the Gluon probe's shared-memory ring kernel beside the engine's one-row kernel.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
PYTHONPATH=benchmarks:. timeout 300 python3 benchmarks/gluon_gemv_probe.py --ring-only \
    --out "$OUT/gluon_gemv_ring.json" 2>&1 | grep -v Warn | tail -60
