import sys
from functools import partial
import torch
from decode_fp8_dots_sweep import HEAD_DIM, PLACEMENT, inputs
from kiln.kernels.triton import decode_attention as da
from kiln.kernels.triton import decode_attention_pf as packed_pf
PLACEMENT["mode"] = "random"
a = [int(x) for x in sys.argv[1:]]
tiles = (a[0], a[1])
q, k8, v8, table, lens = inputs(768, 1500)
for _ in range(2):
    da.paged_decode_attention(q, k8, v8, table, lens, HEAD_DIM**-0.5, 1500)
    packed_pf.decode_pf(q, k8, v8, table, lens, HEAD_DIM**-0.5, 1500, tiles, k_asm=bool(a[2]), natural=bool(a[3]), stages=a[4])
torch.cuda.synchronize()
