import os, sys
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, "tests")  # after git apply decode_pf.patch
import torch
from kiln.kernels.triton import decode_attention_pf as packed_pf
from kiln.kernels import reference
FP8 = torch.float8_e4m3fn
def run(seq_lens, heads, kvh, hd, bs, splits, bn):
    gen = torch.Generator().manual_seed(0)
    nb = sum(-(-n // bs) for n in seq_lens) + 3
    k = torch.randn(nb, bs, kvh, hd, generator=gen).to(FP8)
    v = torch.randn(nb, bs, kvh, hd, generator=gen).to(FP8)
    order = torch.randperm(nb, generator=gen)
    bt = torch.zeros(len(seq_lens), max(-(-n // bs) for n in seq_lens) + 1, dtype=torch.int32)
    u = 0
    for i, n in enumerate(seq_lens):
        m = -(-n // bs); bt[i, :m] = order[u:u+m].int(); u += m
    q = torch.randn(len(seq_lens), heads, hd, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = reference.paged_decode_attention(q, k.float(), v.float(), bt, lens, hd**-0.5, max(seq_lens))
    out = packed_pf.decode_pf(q, k, v, bt, lens, hd**-0.5, max(seq_lens), (bn, 4), num_splits=splits, natural=NAT, stages=3 if NAT else 1)
    err = (out - ref).abs().max().item()
    print(seq_lens, heads, kvh, bs, splits, bn, "max err", err)
    assert err < 1e-4, err
for NAT in (False, True):
  for splits in (1, 3):
    for bn in (8, 16):
        run([1, 13, 137], 8, 2, 16, 4, splits, bn)
        run([5, 70, 64], 8, 2, 16, 16, splits, bn)
        run([5, 70, 64], 4, 2, 16, 16, splits, bn)
        run([5, 70, 64], 16, 2, 16, 32, splits, bn)
print("ok")
