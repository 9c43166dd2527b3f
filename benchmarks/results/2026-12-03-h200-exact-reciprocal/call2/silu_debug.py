"""Where the fused SiLU-mul + quantize codes differ from the unfused kernels' / the division."""
import torch, triton, triton.language as tl, json, sys
from kiln.kernels.triton import silu_mul, fp8_gemm
from kiln.kernels import reference

@triton.jit
def _v_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    v = silu_mul._silu_mul_block(x_ptr + row * 2 * d, cols, d, False)
    tl.store(out_ptr + row * d + cols, v, mask=cols < d)

@triton.jit
def _q_kernel(v_ptr, out_ptr, scale_ptr, n, DYNAMIC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + cols, mask=cols < n)
    scale = tl.load(scale_ptr)
    q = fp8_gemm.scaled_to_e4m3(v, scale, tl.math.div_rn(1.0, scale), DYNAMIC, 448.0, False)
    tl.store(out_ptr + cols, q, mask=cols < n)

res = {}
gen = torch.Generator(device="cuda").manual_seed(0)
INTER = 14336
for rows in (512,):
    x = torch.randn(rows, 2 * INTER, device="cuda", generator=gen).bfloat16()
    static = torch.tensor(0.05, device="cuda")
    fused, _ = silu_mul.silu_and_mul_quant_fp8(x, static)
    v_unf = silu_mul.silu_and_mul(x)
    v_fused = torch.empty(rows, INTER, device="cuda")
    _v_kernel[(rows,)](x, v_fused, INTER, BLOCK=16384)
    res["v_fused_vs_unfused_differ"] = int((v_fused != v_unf.float()).sum())
    ref = (v_unf.float() / static).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    refv = (v_fused / static).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    res["fused_vs_div_of_unfused_v"] = int((fused.view(torch.uint8) != ref).sum())
    res["fused_vs_div_of_fused_v"] = int((fused.view(torch.uint8) != refv).sum())
    q = torch.empty_like(v_fused)
    _q_kernel[(triton.cdiv(v_fused.numel(), 1024),)](v_fused, q, static, v_fused.numel(), DYNAMIC=False, BLOCK=1024)
    qc = q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    exact_q = v_fused / static
    res["scaled_fn_fp32_vs_div"] = int((q != exact_q.clamp(-448,448)).sum())
    idx = torch.nonzero(fused.view(torch.uint8) != ref)[:20]
    res["examples"] = [
        {"gate": float(x[i, j]), "up": float(x[i, INTER + j]), "v_unf": float(v_unf[i, j]),
         "v_fused": float(v_fused[i, j]), "code_fused": int(fused.view(torch.uint8)[i, j]),
         "code_ref": int(ref[i, j]), "q_fn": float(q[i, j]), "q_div": float(exact_q[i, j])}
        for i, j in idx.tolist()]
# the all-gates case of the test
gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
gates = gates[torch.isfinite(gates)].view(256, 255).cuda()
xg = torch.cat([gates, torch.ones_like(gates)], dim=1)
vf = torch.empty(256, 255, device="cuda")
_v_kernel[(256,)](xg, vf, 255, BLOCK=256)
vu = silu_mul.silu_and_mul(xg).float()
d = torch.nonzero(vf != vu)
res["gates_v_differ"] = int(d.shape[0])
res["gates_examples"] = [{"gate": float(gates[i, j]), "v_fused": float(vf[i, j]), "v_unf": float(vu[i, j])} for i, j in d[:30].tolist()]
json.dump(res, open(sys.argv[1], "w"), indent=1)
print(json.dumps(res)[:3000])
