"""A target for Nsight Compute: the engine's one-row float8 projections (batch-1 decode), one
call each inside the profiled range, Llama-3.1-8B shapes, static activation scales.

    PYTHONPATH=.:benchmarks ncu --profile-from-start off --section SpeedOfLight \
        --section WarpStateStats --metrics regex:smsp__average_warps_issue_stalled_.* \
        python3 benchmarks/ncu_one_row.py qkv,o_proj,gate_up,down

Every projection runs once first (compiles, and leaves nothing of the profiled weight copy in
L2: each profiled call reads its second copy), then once between cudaProfilerStart and Stop.
"""

from __future__ import annotations

import sys

import torch
from small_batch_swap_ab import Projection  # benchmarks/, the script's own folder


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["qkv", "o_proj", "gate_up", "down"]
    projections = [Projection(name, 1, "cuda") for name in names]
    for proj in projections:
        proj.call(proj.fused_op(), proj.weights[0])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for proj in projections:
        proj.call(proj.fused_op(), proj.weights[1])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
