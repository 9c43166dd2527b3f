"""Call 5: the small-batch float8 matmul at outlier-column shapes (K + 16, rows 128 bytes apart)
with the tiles measured for K (split-K 4), against reference.fp8_matmul on the H200.

    PYTHONPATH=. python3 benchmarks/results/2026-12-05-h200-outlier-e2e-one-row-cost/call5/check.py
"""

import torch

from kiln.kernels import reference
from kiln.kernels.triton import fp8_gemm, small_batch_tiles
from kiln.kernels.triton import small_batch_linear as sbl

torch.manual_seed(0)
for n, k in ((4096, 4096 + 16), (4096, 14336 + 16), (28672, 4096 + 16)):
    tiles = small_batch_tiles.tile_config("linear", n, k, torch.device("cuda"), 1, rows=1)
    w = fp8_gemm.aligned_rows(n, k, torch.device("cuda"))
    w.copy_((torch.randn(n, k, device="cuda") * 20).clamp(-448, 448).to(torch.float8_e4m3fn))
    ws = torch.rand(n, device="cuda") * 1e-3
    for rows in (1, 4):
        x = fp8_gemm.aligned_rows(rows, k, torch.device("cuda"))
        x.copy_((torch.randn(rows, k, device="cuda") * 50).clamp(-448, 448).to(x.dtype))
        for scale in (torch.tensor(0.01, device="cuda"), torch.rand(rows, 1, device="cuda")):
            got = sbl.fp8_matmul(x, scale, w, ws, None, torch.bfloat16)
            want = reference.fp8_matmul(x, scale, w, ws, None, torch.bfloat16)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            print(n, k, rows, tuple(scale.shape), tuple(tiles), f"rel err {err:.2e}")
            assert err < 1e-2, err
print("ok")
