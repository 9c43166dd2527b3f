#!/usr/bin/env bash
# Call 1: the Gluon one-row FP8 GEMV probe beside the engine's one-row kernel, four shapes.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
PYTHONPATH=benchmarks:. timeout 400 python3 benchmarks/gluon_gemv_probe.py \
    --out "$OUT/gluon_gemv.json" 2>&1 | grep -v Warn | tail -60
