#!/usr/bin/env bash
# Prefill attention over a float8 cache staged into fp16, against widened in the kernel; the
# softmax's scale folded into one FMA (tree without it: .scratch/nofold). GPU tests first.
set -u
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $R/gpu.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "prefill or backend or fp8_to_fp16" > $R/tests_gpu.txt 2>&1
tail -3 $R/tests_gpu.txt
cd benchmarks
PYTHONPATH=../.scratch/nofold timeout 120 python3 prefill_fp8_staging_sweep.py --no-grid --out $R/staging_nofold.json 2>&1 | grep -v "^ "
PYTHONPATH=.. timeout 120 python3 prefill_fp8_staging_sweep.py --no-grid --out $R/staging_fold.json 2>&1 | grep -v "^ "
PYTHONPATH=.. timeout 300 python3 prefill_fp8_staging_sweep.py --out $R/staging_grid.json 2>&1 | tail -20
cd $OUT && tar czf r.tgz r && rm -rf r
