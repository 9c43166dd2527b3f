"""How fast can a one-row FP8 projection be with a chain as short as it gets? A probe in Gluon
(Triton 3.6's explicit-layout dialect), timed beside the engine's one-row kernel on the GPU.

Batch-1 decode misses 420 tok/s by ~4 us a kernel of fixed cost beyond the bytes
(docs/performance.md, "Batch 1: the round-trip cuts again ... what 420 would take"): the engine's
kernel streams [BLOCK_N, K] tiles through shared memory into a wgmma, a split-K program over 4
K-steps, then hands its partial sum to the tile's last program. This probe has no shared memory,
no barrier and no split: each warp owns ROWS whole weight rows, its lanes load 16 bytes each of
every row straight into registers (the next UNROLL x 512-byte piece of each row issued before the
current one is used), multiply on the CUDA cores by the row's float8-quantized activations (the
engine's static-scale quotient), and reduce across the warp's lanes with shuffles. The chain is:
launch, the first wait on HBM, the stream, one warp reduction, one store.

    PYTHONPATH=. python3 benchmarks/gluon_gemv_probe.py --out gluon_gemv.json

Every configuration is checked against the twin (reference.fp8_linear) before it is timed; the
engine's fp8_linear at the same shape is the baseline, in the same CUDA-graph timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

FP8_MAX = gl.constexpr(448.0)
L2_BYTES = 50 * 2**20
SHAPES = {  # name: (weight rows, K) at Llama-3.1-8B's decode (gate_up and qkv: their plain GEMV)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
# (rows a warp, 512-byte pieces a step, warps a program)
CONFIGS = [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 4), (4, 1, 4), (1, 4, 4), (2, 2, 8), (4, 2, 4)]
# The ring kernel: (rows a warp, 512-byte pieces a step, steps in flight, warps a program)
RING_CONFIGS = [(2, 1, 8, 4), (2, 1, 12, 4), (4, 1, 8, 4), (2, 2, 6, 4), (1, 2, 8, 4), (4, 1, 6, 8),
                (2, 1, 8, 8), (8, 1, 4, 4)]  # fmt: skip


@gluon.jit
def _quantized_row(v, scale, inv_scale):
    """The engine's static-scale quotient (fp8_gemm.scaled_to_e4m3), rounded to e4m3, as fp32."""
    q = v * inv_scale
    q = gl.minimum(gl.maximum(q, -2 * FP8_MAX), 2 * FP8_MAX)
    r = gl.fma(q, scale, v * -1.0)
    q = gl.minimum(gl.maximum(gl.fma(r, inv_scale * -1.0, q), -FP8_MAX), FP8_MAX)
    return q.to(gl.float8e4nv).to(gl.float32)


@gluon.jit
def _gemv_fp8_kernel(
    x_ptr,  # [K] bf16: the row
    w_ptr,  # [N, K] float8 e4m3
    w_scale_ptr,  # [N] fp32
    in_scale_ptr,  # [] fp32 static activation scale
    out_ptr,  # [N] bf16
    N,
    K,
    ROWS: gl.constexpr,  # weight rows a warp
    UNROLL: gl.constexpr,  # 512-byte pieces of each row a step
    num_warps: gl.constexpr,
):
    # A lane holds 16 consecutive bytes of a row per 512-byte piece: one 128-bit load each; the
    # K axis lies inside one warp, so the row sums need shuffles only.
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [num_warps, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    k_layout: gl.constexpr = gl.SliceLayout(0, layout)
    BLOCK_N: gl.constexpr = ROWS * num_warps
    CHUNK: gl.constexpr = 512 * UNROLL
    rows = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=row_layout)
    ks = gl.arange(0, CHUNK, layout=k_layout)
    row_mask = rows < N
    w_rows = w_ptr + gl.expand_dims(rows.to(gl.int64) * K, 1)
    scale = gl.load(in_scale_ptr)
    inv_scale = gl.div_rn(1.0, scale)
    w_scale = gl.load(w_scale_ptr + rows, mask=row_mask, other=0.0)  # before the stream
    acc = gl.zeros([BLOCK_N], gl.float32, layout=row_layout)
    w_next = gl.load(
        w_rows + gl.expand_dims(ks, 0),
        mask=gl.expand_dims(row_mask, 1) & gl.expand_dims(ks < K, 0),
        other=0.0,
    )
    x_next = gl.load(x_ptr + ks, mask=ks < K, other=0.0)
    for k in range(0, K, CHUNK):
        w = w_next
        v = x_next.to(gl.float32)
        k_next = k + CHUNK + ks
        w_next = gl.load(
            w_rows + gl.expand_dims(k_next, 0),
            mask=gl.expand_dims(row_mask, 1) & gl.expand_dims(k_next < K, 0),
            other=0.0,
        )
        x_next = gl.load(x_ptr + k_next, mask=k_next < K, other=0.0)
        q = _quantized_row(v, scale, inv_scale)
        acc += gl.sum(w.to(gl.float32) * gl.expand_dims(q, 0), axis=1)
    out = acc * scale * w_scale
    gl.store(out_ptr + rows, out.to(gl.bfloat16), mask=row_mask)


@gluon.jit
def _gemv_fp8_ring_kernel(
    x_ptr,  # [K] bf16: the row
    w_ptr,  # [N, K] float8 e4m3
    w_scale_ptr,  # [N] fp32
    in_scale_ptr,  # [] fp32 static activation scale
    out_ptr,  # [N] bf16
    N,
    K,
    ROWS: gl.constexpr,  # weight rows a warp
    UNROLL: gl.constexpr,  # 512-byte pieces of each row a step
    STAGES: gl.constexpr,  # steps in flight (cp.async into a shared-memory ring)
    num_warps: gl.constexpr,
):
    """_gemv_fp8_kernel with the weight in flight in shared memory instead of registers: each
    lane copies its 16 bytes of each row (cp.async) STAGES - 1 steps ahead and reads back only
    what it copied itself, so no barrier is needed between the copy and the read."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [num_warps, 1], [1, 0])
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    k_layout: gl.constexpr = gl.SliceLayout(0, layout)
    ring_layout: gl.constexpr = gl.SwizzledSharedLayout(16, 1, 1, [1, 0])
    BLOCK_N: gl.constexpr = ROWS * num_warps
    CHUNK: gl.constexpr = 512 * UNROLL
    rows = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=row_layout)
    ks = gl.arange(0, CHUNK, layout=k_layout)
    row_mask = gl.expand_dims(rows < N, 1)
    w_rows = w_ptr + gl.expand_dims(rows.to(gl.int64) * K, 1)
    ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, CHUNK], ring_layout)
    for s in gl.static_range(STAGES - 1):
        k_s = s * CHUNK + ks
        async_copy.async_copy_global_to_shared(
            ring.index(s), w_rows + gl.expand_dims(k_s, 0),
            mask=row_mask & gl.expand_dims(k_s < K, 0),
        )  # fmt: skip
        async_copy.commit_group()
    scale = gl.load(in_scale_ptr)
    inv_scale = gl.div_rn(1.0, scale)
    w_scale = gl.load(w_scale_ptr + rows, mask=rows < N, other=0.0)
    acc = gl.zeros([BLOCK_N], gl.float32, layout=row_layout)
    x_next = gl.load(x_ptr + ks, mask=ks < K, other=0.0)
    steps = gl.cdiv(K, CHUNK)
    for i in range(0, steps):
        # The step STAGES - 1 ahead goes into the slot step i - 1 was read from.
        k_ahead = (i + STAGES - 1) * CHUNK + ks
        async_copy.async_copy_global_to_shared(
            ring.index((i + STAGES - 1) % STAGES), w_rows + gl.expand_dims(k_ahead, 0),
            mask=row_mask & gl.expand_dims(k_ahead < K, 0),
        )  # fmt: skip
        async_copy.commit_group()
        v = x_next.to(gl.float32)
        k_next = (i + 1) * CHUNK + ks
        x_next = gl.load(x_ptr + k_next, mask=k_next < K, other=0.0)
        async_copy.wait_group(STAGES - 1)  # step i's copies have landed
        w = ring.index(i % STAGES).load(layout)
        q = _quantized_row(v, scale, inv_scale)
        acc += gl.sum(w.to(gl.float32) * gl.expand_dims(q, 0), axis=1)
    async_copy.wait_group(0)
    out = acc * scale * w_scale
    gl.store(out_ptr + rows, out.to(gl.bfloat16), mask=rows < N)


def gemv_fp8_ring(x, w, w_scale, in_scale, rows: int, unroll: int, stages: int,
                  num_warps: int) -> torch.Tensor:  # fmt: skip
    n, k = w.shape
    out = torch.empty(n, dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(n, rows * num_warps),)
    _gemv_fp8_ring_kernel[grid](
        x, w, w_scale, in_scale, out, n, k, rows, unroll, stages, num_warps=num_warps
    )  # fmt: skip
    return out


def gemv_fp8(x, w, w_scale, in_scale, rows: int, unroll: int, num_warps: int) -> torch.Tensor:
    n, k = w.shape
    out = torch.empty(n, dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(n, rows * num_warps),)
    _gemv_fp8_kernel[grid](
        x, w, w_scale, in_scale, out, n, k, rows, unroll, num_warps=num_warps
    )  # fmt: skip
    return out


def _time_us(fn, weights: list[torch.Tensor], reps: int) -> float:
    """us a call of fn(w), back to back over every weight copy in one CUDA graph."""
    from tile_sweep import graph_time_ms  # benchmarks/

    calls = [functools.partial(fn, w) for w in weights]
    return 1000 * graph_time_ms(calls, max(1, reps // len(weights)), 5)


def _shape_entry(name: str, reps: int, configs: list[tuple[int, int, int]]) -> dict:
    from kiln.kernels import reference
    from kiln.kernels.triton import small_batch_linear as sbl

    n, k = SHAPES[name]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    copies = max(2, math.ceil(3 * L2_BYTES / (n * k)))
    weights = [
        (0.05 * torch.randn(n, k, device=dev, generator=g)).to(torch.float8_e4m3fn)
        for _ in range(copies)
    ]
    w_scale = 0.01 + 0.01 * torch.rand(n, device=dev, generator=g)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
    in_scale = torch.tensor(4.0 / 448, device=dev)
    truth = reference.fp8_linear(x, weights[0], w_scale, in_scale).float().view(-1)
    peak = truth.abs().max().item()

    def engine(w: torch.Tensor) -> torch.Tensor:
        return sbl.fp8_linear(x, w, w_scale, in_scale)

    entry = {
        "n": n, "k": k, "floor_us_at_3.0TB/s": n * k / 3.0e12 * 1e6,
        "engine_us": _time_us(engine, weights, reps),
        "engine_rel_err": (engine(weights[0]).float().view(-1) - truth).abs().max().item() / peak,
        "probe": [],
    }  # fmt: skip
    print(f"{name:8s} engine {entry['engine_us']:7.2f} us err {entry['engine_rel_err']:.1e}")
    for rows, unroll, warps in configs:

        def probe(w: torch.Tensor, rows=rows, unroll=unroll, warps=warps) -> torch.Tensor:
            return gemv_fp8(x.view(-1), w, w_scale, in_scale, rows, unroll, warps)

        try:
            err = (probe(weights[0]).float() - truth).abs().max().item() / peak
            us = _time_us(probe, weights, reps)
        except Exception as exc:  # a configuration that does not compile: reported
            print(name, rows, unroll, warps, "failed:", type(exc).__name__, exc)
            continue
        entry["probe"].append(
            {"rows": rows, "unroll": unroll, "warps": warps, "us": us, "rel_err": err}
        )
        print(f"{name:8s} rows {rows} unroll {unroll} warps {warps} {us:7.2f} us err {err:.1e}")
    entry["ring"] = []
    for rows, unroll, stages, warps in RING_CONFIGS:

        def ring(w: torch.Tensor, rows=rows, unroll=unroll, stages=stages, warps=warps):
            return gemv_fp8_ring(x.view(-1), w, w_scale, in_scale, rows, unroll, stages, warps)

        try:
            err = (ring(weights[0]).float() - truth).abs().max().item() / peak
            us = _time_us(ring, weights, reps)
        except Exception as exc:  # e.g. out of shared memory: reported
            print(name, "ring", rows, unroll, stages, warps, "failed:", type(exc).__name__, exc)
            continue
        entry["ring"].append(
            {"rows": rows, "unroll": unroll, "stages": stages, "warps": warps, "us": us,
             "rel_err": err}
        )  # fmt: skip
        print(f"{name:8s} ring rows {rows} unroll {unroll} stages {stages} warps {warps} "
              f"{us:7.2f} us err {err:.1e}")  # fmt: skip
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--ring-only", action="store_true", help="skip the register kernel")
    args = parser.parse_args()
    configs = [] if args.ring_only else CONFIGS
    result = {"gpu": torch.cuda.get_device_name(), "shapes": {}}
    for name in args.shapes.split(","):
        result["shapes"][name] = _shape_entry(name, args.reps, configs)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
