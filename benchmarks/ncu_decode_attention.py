"""A target for Nsight Compute: decode attention over float8 and bf16 caches at one shape.

    cd benchmarks && PYTHONPATH=.. ncu --kernel-name regex:_decode_kernel --launch-skip 2 \
        --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 ncu_decode_attention.py 384 1500

Each cache's kernel runs twice (float8 first): skipping two launches profiles the second pair.
"""

from __future__ import annotations

import sys

import torch
from decode_fp8_dots_sweep import HEAD_DIM, inputs  # benchmarks/, the script's folder

from kiln.kernels.triton import decode_attention as da


def main() -> None:
    batch, context = int(sys.argv[1]), int(sys.argv[2])
    q, k8, v8, table, lens = inputs(batch, context)
    kb, vb = k8.bfloat16(), v8.bfloat16()
    for _ in range(2):
        da.paged_decode_attention(q, k8, v8, table, lens, HEAD_DIM**-0.5, context)
        da.paged_decode_attention(q, kb, vb, table, lens, HEAD_DIM**-0.5, context)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
