#!/usr/bin/env bash
# Exact reciprocal (sign fix) tests and codes; the packed decode loops' GPU tests and sweep.
set -u
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_reciprocal.py > $R/tests_recip_gpu.txt 2>&1; tail -2 $R/tests_recip_gpu.txt
cd benchmarks
PYTHONPATH=../.scratch/base timeout 60 python3 quant_kernels_time.py --out $R/quant_base.json --codes $R/codes_base.pt 2>&1 | tail -1
PYTHONPATH=.. timeout 60 python3 quant_kernels_time.py --out $R/quant_exact.json --compare $R/codes_base.pt 2>&1 | tail -1
rm -f $R/codes_base.pt
cd ..
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k "packed or decode" > $R/tests_packed_gpu.txt 2>&1; tail -2 $R/tests_packed_gpu.txt
PYTHONPATH=. timeout 260 python3 benchmarks/decode_packed_sweep.py --loops 1,2,3 --shapes 768x1500,384x1500,512x192,64x4096 --out $R/decode_packed.json 2>&1 | tail -40
