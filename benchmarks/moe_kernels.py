"""The mixture-of-experts rows of benchmarks/kernels_gpu.py, at Qwen3-30B-A3B's shapes (128
experts, top-8, hidden 2048, expert width 768; tokens routed uniformly at random):

- moe_grouped_fp8: the float8 tensor-core grouped GEMM at a prefill's 8192 tokens, each tile
  candidate (kiln.kernels.triton.moe_fp8.FP8_TILE_CANDIDATES): its gate_up and down launches
  alone and the whole fused_moe_fp8 call (quantization, sort, activation, sum included), in
  TFLOP/s and as a fraction of the GPU's dense FP8 peak; beside the bf16 grouped GEMM and the
  block-scaled one (128x128 weight blocks, fused_moe_fp8_block, untuned tiles).
- moe_decode: batch 1, 4 and 16, bf16, float8 and block-scaled float8 experts: the decode kernels
  (fused_moe_decode, and each of moe_decode.DECODE_TILE_CANDIDATES) against the grouped GEMM
  (fused_moe), in GB/s of the distinct experts the step reads (the roofline's bytes). The calls
  rotate over 16 routings, so the experts one call reads are mostly not in L2 from the last.
  Also the block after its router: rms_norm + moe_route + fused_moe_decode (norm_route_decode)
  against fused_moe_decode_routed (decode_routed: the norm and routing inside its kernels).
- moe_int4: INT4 W4A16 experts (random codes, groups of 128, scales and zeros): the grouped
  GEMM dequantizing its tiles (fused_moe_int4) at the prefill's tokens in TFLOP/s, and the
  decode GEMVs (fused_moe_int4_decode) at batch 1, 4 and 16 in GB/s of the distinct experts'
  packed words, scales and zeros.
- moe_route: the fused router against the reference's five launches, at 1 and 16 tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Dense (no sparsity) FP8 tensor-core peaks in TFLOP/s, by a substring of the device name.
FP8_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("H20", 296.0))


@dataclass(frozen=True)
class MoeShapes:
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    prefill_tokens: int
    decode_batches: tuple[int, ...]
    dtype: torch.dtype


QWEN3_30B_A3B = MoeShapes(128, 8, 2048, 768, 8192, (1, 4, 16), torch.bfloat16)
TINY = MoeShapes(8, 2, 64, 48, 40, (1, 3), torch.float32)


def fp8_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in FP8_PEAK_TFLOPS if key in name), None)


def _routing(tokens: int, s: MoeShapes, gen: torch.Generator, device: torch.device):
    scores = torch.rand(tokens, s.num_experts, generator=gen, device=device)
    weights, ids = torch.topk(scores, s.top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).float(), ids


def _experts(s: MoeShapes, gen: torch.Generator, device: torch.device):
    from kiln.layers.moe import quantize_experts_fp8

    w13 = torch.randn(s.num_experts, 2 * s.inter, s.hidden, generator=gen, device=device) * 0.02
    w2 = torch.randn(s.num_experts, s.hidden, s.inter, generator=gen, device=device) * 0.02
    w13, w2 = w13.to(s.dtype), w2.to(s.dtype)
    (w13_fp8, s13), (w2_fp8, s2) = quantize_experts_fp8(w13), quantize_experts_fp8(w2)
    return (w13, w2), (w13_fp8, w2_fp8, s13, s2)


def _block_experts(w13: torch.Tensor, w2: torch.Tensor):
    """The experts rounded per 128x128 block (Qwen's / DeepSeek's FP8 format)."""
    from kiln.layers.moe_fp8_block import quantize_experts_fp8_block

    (w13_fp8, s13), (w2_fp8, s2) = quantize_experts_fp8_block(w13), quantize_experts_fp8_block(w2)
    return w13_fp8, w2_fp8, s13, s2


def _err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


def moe_rows(s: MoeShapes, device: torch.device, gen: torch.Generator, record: Callable) -> None:
    """Every MoE row; `record(kernel, case, impl, calls, graph=True, **extra)` times and prints
    them (kernels_gpu.run's)."""
    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops
    from kiln.kernels.triton import moe_decode, moe_fp8
    from kiln.kernels.triton.fused_moe import align_by_expert
    from kiln.kernels.triton.silu_mul import silu_and_mul_quant_fp8

    (w13, w2), (w13_fp8, w2_fp8, s13, s2) = _experts(s, gen, device)
    peak = fp8_peak_tflops(device)
    # --- prefill: the float8 grouped GEMM's tiles ---------------------------------------------
    tokens = s.prefill_tokens
    pairs = tokens * s.top_k
    x = torch.randn(tokens, s.hidden, generator=gen, device=device).to(s.dtype)
    weights, ids = _routing(tokens, s, gen, device)
    fp8_args = (x, w13_fp8, w2_fp8, weights, ids, s13, s2)
    gate_up_flops = 2 * pairs * 2 * s.inter * s.hidden
    down_flops = 2 * pairs * s.hidden * s.inter
    case = f"tokens={tokens} E={s.num_experts} k={s.top_k}"
    expected = reference.fused_moe_fp8(*fp8_args)
    x_fp8, x_scale = triton_ops.quantize_fp8(x, None)
    flat = weights.reshape(-1).contiguous()
    candidates = moe_fp8.FP8_TILE_CANDIDATES if device.type == "cuda" else (None,)
    for tiles in candidates:
        tiles = tiles or moe_fp8._INTERPRETER_TILES
        label = "x".join(map(str, tiles))
        aligned = align_by_expert(ids, s.num_experts, tiles[0])
        gate_up = torch.empty(pairs, 2 * s.inter, dtype=s.dtype, device=device)
        down = torch.empty(pairs, s.hidden, dtype=torch.float32, device=device)

        def gemm1(t=tiles, a=aligned, out=gate_up) -> None:
            moe_fp8._fp8_grouped_gemm(x_fp8, x_scale, w13_fp8, s13, out, flat, a, s.top_k,
                                      False, t)  # fmt: skip

        try:
            gemm1()
        except Exception as exc:  # a tile that does not fit this GPU's shared memory
            print(f"moe_grouped_fp8    tiles={label}: {type(exc).__name__}: {exc}"[:300])
            continue
        act_fp8, act_scale = silu_and_mul_quant_fp8(gate_up, None)

        def gemm2(t=tiles, a=aligned, act=act_fp8, sc=act_scale, out=down) -> None:
            moe_fp8._fp8_grouped_gemm(act, sc, w2_fp8, s2, out, flat, a, 1, True, t)

        whole = moe_fp8.fused_moe_fp8_tiled(*fp8_args, tiles)
        for impl, call, flops, extra in (
            ("fp8_gate_up", gemm1, gate_up_flops, {}),
            ("fp8_down", gemm2, down_flops, {}),
            ("fp8_whole", lambda t=tiles: moe_fp8.fused_moe_fp8_tiled(*fp8_args, t),
             gate_up_flops + down_flops, {"max_abs_err": _err(whole, expected)}),
        ):  # fmt: skip
            record("moe_grouped_fp8", case, impl, [call], flops=flops, tiles=label,
                   fp8_peak_tflops=peak, **extra)  # fmt: skip
    block_experts = _block_experts(w13, w2)
    block_args = (x, block_experts[0], block_experts[1], weights, ids, *block_experts[2:])
    block_err = _err(triton_ops.fused_moe_fp8_block(*block_args),
                     reference.fused_moe_fp8_block(*block_args))  # fmt: skip
    record("moe_grouped_fp8", case, "fp8_block_whole",
           [lambda: triton_ops.fused_moe_fp8_block(*block_args)], flops=gate_up_flops + down_flops,
           fp8_peak_tflops=peak, max_abs_err=block_err)  # fmt: skip
    bf16_args = (x, w13, w2, weights, ids)
    bf16_err = _err(triton_ops.fused_moe(*bf16_args), reference.fused_moe(*bf16_args))
    record("moe_grouped_fp8", case, f"{str(s.dtype).removeprefix('torch.')}_whole",
           [lambda: triton_ops.fused_moe(*bf16_args)], flops=gate_up_flops + down_flops,
           max_abs_err=bf16_err)  # fmt: skip

    # --- decode: only the chosen experts' bytes ------------------------------------------------
    dtype_name = str(s.dtype).removeprefix("torch.")
    block_scales = 2 * s.inter * -(-s.hidden // 128) + s.hidden * -(-s.inter // 128)
    per_expert = {
        dtype_name: 3 * s.hidden * s.inter * w13.element_size(),
        "fp8": 3 * s.hidden * s.inter + 8,
        "fp8_block": 3 * s.hidden * s.inter + 4 * block_scales,
    }
    for batch in s.decode_batches:
        xs = torch.randn(batch, s.hidden, generator=gen, device=device).to(s.dtype)
        routings = [_routing(batch, s, gen, device) for _ in range(16)]
        distinct = sum(r[1].unique().numel() for r in routings) / len(routings)
        for kind, weights_args in ((dtype_name, (w13, w2, None, None)),
                                   ("fp8", (w13_fp8, w2_fp8, s13, s2)),
                                   ("fp8_block", block_experts)):  # fmt: skip
            a, b, sa, sb = weights_args
            all_args = [(xs, a, b, w, i, sa, sb) for w, i in routings]
            step_bytes = distinct * per_expert[kind]
            want = reference.fused_moe_decode(*all_args[0])
            grouped = (
                triton_ops.fused_moe_fp8_block if kind == "fp8_block" else triton_ops.fused_moe
            )
            for impl, fn in (("decode", triton_ops.fused_moe_decode),
                             ("grouped", grouped)):  # fmt: skip
                record("moe_decode", f"batch={batch} {kind}", impl,
                       [lambda f=fn, args=args: f(*args) for args in all_args],
                       bytes=step_bytes, max_abs_err=_err(fn(*all_args[0]), want))  # fmt: skip
            # The block after its router: the norm, the routing and the experts as three ops,
            # or as the two launches that norm and route inside the experts' first.
            norm_weight = torch.ones(s.hidden, dtype=s.dtype, device=device)
            logits = [torch.randn(batch, s.num_experts, generator=gen, device=device).to(s.dtype)
                      for _ in routings]  # fmt: skip

            def unfused(z, a=a, b=b, sa=sa, sb=sb, xs=xs, nw=norm_weight):
                normed = triton_ops.rms_norm(xs, nw, 1e-6)
                w, i = triton_ops.moe_route(z, s.top_k, True, s.dtype)
                return triton_ops.fused_moe_decode(normed, a, b, w, i, sa, sb)

            routed_args = [(xs, norm_weight, 1e-6, z, s.top_k, True, a, b, sa, sb) for z in logits]
            routed_want = reference.fused_moe_decode_routed(*routed_args[0])
            record("moe_decode", f"batch={batch} {kind}", "norm_route_decode",
                   [lambda z=z: unfused(z) for z in logits], bytes=step_bytes,
                   max_abs_err=_err(unfused(logits[0]), routed_want))  # fmt: skip
            record("moe_decode", f"batch={batch} {kind}", "decode_routed",
                   [lambda r=r: triton_ops.fused_moe_decode_routed(*r) for r in routed_args],
                   bytes=step_bytes,
                   max_abs_err=_err(triton_ops.fused_moe_decode_routed(*routed_args[0]),
                                    routed_want))  # fmt: skip
            if device.type != "cuda":
                continue
            for tiles in moe_decode.DECODE_TILE_CANDIDATES:
                record("moe_decode", f"batch={batch} {kind}", "decode_tiles",
                       [lambda t=tiles, a=args: moe_decode.fused_moe_decode_tiled(*a, t)
                        for args in all_args],
                       bytes=step_bytes, tiles="x".join(map(str, tiles)),
                       max_abs_err=_err(moe_decode.fused_moe_decode_tiled(*all_args[0], tiles),
                                        want))  # fmt: skip

    int4_rows(s, x, weights, ids, device, gen, record)

    # --- the router -------------------------------------------------------------------------
    for batch in (1, 16):
        logits = torch.randn(batch, s.num_experts, generator=gen, device=device).to(s.dtype)
        for impl, ops in (("triton", triton_ops), ("reference", reference)):
            record("moe_route", f"tokens={batch} E={s.num_experts}", impl,
                   [lambda o=ops, z=logits: o.moe_route(z, s.top_k, True, s.dtype)])  # fmt: skip


def _int4_experts(s: MoeShapes, gen: torch.Generator, device: torch.device):
    """Random INT4 experts: packed codes, group scales about the dense INT4's dummy one, zeros."""
    group = 128 if s.hidden % 128 == 0 and s.inter % 128 == 0 else 16

    def one(rows: int, cols: int):
        words = torch.randint(-(2**31), 2**31 - 1, (s.num_experts, rows, cols // 8),
                              generator=gen, device=device, dtype=torch.int32)  # fmt: skip
        shape = (s.num_experts, rows, cols // group)
        scales = torch.rand(shape, generator=gen, device=device) * 0.002 + 0.002
        zeros = torch.randint(0, 16, shape, generator=gen, device=device).float()
        return words, scales, zeros

    (w13, s13, z13), (w2, s2, z2) = one(2 * s.inter, s.hidden), one(s.hidden, s.inter)
    return (w13, w2, s13, s2, z13, z2), group


def int4_rows(
    s: MoeShapes,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    device: torch.device,
    gen: torch.Generator,
    record: Callable,
) -> None:
    """The moe_int4 rows (the module docstring)."""
    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops

    (w13, w2, s13, s2, z13, z2), group = _int4_experts(s, gen, device)
    quant = (s13, s2, z13, z2)
    pairs = x.shape[0] * s.top_k
    flops = 2 * pairs * 3 * s.inter * s.hidden
    args = (x, w13, w2, weights, ids, *quant)
    err = _err(triton_ops.fused_moe_int4(*args), reference.fused_moe_int4(*args))
    record("moe_int4", f"tokens={x.shape[0]} E={s.num_experts} k={s.top_k} g={group}",
           "grouped", [lambda: triton_ops.fused_moe_int4(*args)], flops=flops,
           max_abs_err=err)  # fmt: skip
    scale_bytes = 8 * (2 * s.inter * s.hidden + s.hidden * s.inter) // group
    per_expert = 3 * s.hidden * s.inter // 2 + scale_bytes
    for batch in s.decode_batches:
        xs = torch.randn(batch, s.hidden, generator=gen, device=device).to(s.dtype)
        routings = [_routing(batch, s, gen, device) for _ in range(16)]
        distinct = sum(r[1].unique().numel() for r in routings) / len(routings)
        all_args = [(xs, w13, w2, w, i, *quant) for w, i in routings]
        want = reference.fused_moe_int4_decode(*all_args[0])
        for impl, fn in (("decode", triton_ops.fused_moe_int4_decode),
                         ("grouped", triton_ops.fused_moe_int4)):  # fmt: skip
            record("moe_int4", f"batch={batch} g={group}", impl,
                   [lambda f=fn, a=a: f(*a) for a in all_args], bytes=distinct * per_expert,
                   max_abs_err=_err(fn(*all_args[0]), want))  # fmt: skip
