"""Time each Triton kernel against its pure-PyTorch twin (kiln.kernels.reference) and, for
attention, against torch's scaled_dot_product_attention on equivalent contiguous data, at
Llama-3.1-8B shapes (the mixture-of-experts rows at Qwen3-30B-A3B's: benchmarks/moe_kernels.py).

    python benchmarks/kernels_gpu.py kernels.json
    python benchmarks/kernels_gpu.py kernels_long.json --long   # the long-context rows (issue 54)
    python benchmarks/kernels_gpu.py /tmp/kernels_tiny.json --tiny   # CPU smoke run (interpreter)
    python benchmarks/kernels_gpu.py lora.json --only lora            # the LoRA rows alone
    python benchmarks/kernels_gpu.py moe.json --only moe              # the MoE rows alone
    python benchmarks/kernels_gpu.py int4.json --only int4            # the W4A16 layer rows alone
    python benchmarks/kernels_gpu.py int8.json --only int8            # the W8A8 INT8 layer rows
    python benchmarks/kernels_gpu.py mla.json --only mla              # the MLA decode rows alone
    python benchmarks/kernels_gpu.py dec256.json --only decode256     # Gemma-2-9B's decode rows
    python benchmarks/kernels_gpu.py /tmp/kernels_tiny.json --tiny --long

Each kernel is timed twice: `eager` (triton.testing.do_bench on the Python call, L2 flushed:
includes launch overhead whenever that exceeds the GPU time) and `graph` (the calls captured in a
CUDA graph, as the engine replays decode steps: GPU time only; decode rotates over copies of its
K/V spanning 256 MB so that L2 holds none of it). Rates use the graph time. Decode rows report
achieved bandwidth (bytes of K/V the step must read / time), prefill rows TFLOP/s. Prints a table
and writes JSON (command, git revision, GPU, date, versions, one row per measurement).
Every kernel's output is also compared with the reference (max_abs_err): a fast wrong kernel shows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

# Runnable from a plain checkout (kiln need not be installed): put the repo root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import mla_kernels, moe_kernels
from kiln.kernels.kv_layout import empty_cache


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    block_size: int
    dtype: torch.dtype
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_tokens: int
    prefix_tokens: int  # a chunk of prefill_tokens // 4 after this many cached tokens
    norm_tokens: tuple[int, ...]
    intermediate: int
    lora: tuple[int, int, int]  # LoRA rows: (tokens, adapters, rank)


LLAMA_8B = Shapes(32, 8, 128, 4096, 16, torch.bfloat16, (1, 32, 128), (1024, 4096), 2048, 6144,
                  (128, 2048), 14336, (256, 8, 16))  # fmt: skip
TINY = Shapes(4, 2, 16, 64, 4, torch.float32, (1, 2), (20, 40), 24, 16, (3,), 96, (6, 3, 12))
# Gemma-2-9B's decode over a float8 cache (--only decode256): 16 query heads on 8 KV heads of 256
# dims, logit soft-cap 50, a 4096-key window on alternate layers; batch 1 at 4k and a 1000/1000
# throughput run's ~177 sequences at ~1.5k. Only the attention fields are read.
GEMMA2_9B_DECODE = Shapes(16, 8, 256, 3584, 16, torch.bfloat16, (1, 177), (4096, 1536), 0, 0, (),
                          0, (0, 0, 0))  # fmt: skip
TINY_DECODE256 = Shapes(4, 2, 32, 0, 4, torch.float32, (2,), (20,), 0, 0, (), 0, (0, 0, 0))
GEMMA2_SOFTCAP = 50.0
GEMMA2_WINDOW = 4096


def _git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        # A copy of the tree without .git (e.g. on a remote GPU machine): let the caller say.
        from kiln.envs import envs

        return envs().git_revision or "unknown"


Call = Callable[[], object]
# Decode inputs are replicated until they span this many bytes, and the timed calls rotate over
# the copies, so the K/V a call reads is not left in the 60 MB L2 by the previous call.
ROTATE_BYTES = 256 << 20


def _time_eager(fn: Call, device: torch.device) -> float:
    """Milliseconds per call as launched from Python: triton's do_bench (median, L2 flushed
    between calls) on a GPU, one call's wall clock otherwise. Includes launch overhead when that
    dominates."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    start = time.perf_counter()  # the interpreter compiles nothing: no warm-up call
    fn()
    return (time.perf_counter() - start) * 1e3


def _time_graph(calls: list[Call], target_ms: float = 30.0) -> float:
    """Milliseconds per call with launch overhead removed: the calls, cycled, are captured in one
    CUDA graph (as the engine replays decode steps); median of 5 replays / number of calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile, allocate) off the capture
        for call in calls:
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for call in calls:
            call()
        end.record()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    per_call = max(start.elapsed_time(end) / len(calls), 1e-3)
    rounds = max(1, min(int(target_ms / per_call / len(calls)), 2000 // len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(calls)))
    del graph
    return sorted(times)[len(times) // 2]


def _random(gen: torch.Generator) -> Callable:
    """An allocator for empty_cache: standard normal values drawn from `gen`."""

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    return allocate


def _paged(
    seq_lens: list[int], s: Shapes, device: torch.device, gen: torch.Generator, copies: int = 1
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Caches holding `copies` disjoint sets of these contexts in shuffled blocks, and one block
    table per set."""
    per_seq = [(n + s.block_size - 1) // s.block_size for n in seq_lens]
    num_blocks = sum(per_seq) * copies
    shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    # Head-major blocks, as the engine allocates them (kiln.kernels.kv_layout).
    k_cache, v_cache = (empty_cache(*shape, s.dtype, device, _random(gen)) for _ in "kv")
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    all_tables = []
    used = 0
    for _ in range(copies):
        tables = torch.zeros((len(seq_lens), max(per_seq)), dtype=torch.int32, device=device)
        for i, n in enumerate(per_seq):
            tables[i, :n] = order[used : used + n]
            used += n
        all_tables.append(tables)
    return k_cache, v_cache, all_tables


def _contiguous_kv(
    cache: torch.Tensor, tables: torch.Tensor, length: int
) -> torch.Tensor:  # [num_seqs, num_kv_heads, length, head_dim]
    return cache[tables.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()


def _err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


def run(shapes: Shapes, device: torch.device, only: str | None = None) -> list[dict]:
    import torch.nn.functional as F

    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops

    gen = torch.Generator(device=device).manual_seed(0)
    s = shapes
    elem = torch.finfo(s.dtype).bits // 8
    scale = s.head_dim**-0.5
    rows: list[dict] = []
    bandwidth = 0.0  # the copy bandwidth, where a row kind reports its fraction
    if only == "decode256" and device.type == "cuda":
        from kiln.bench.report import measure_copy_bandwidth

        bandwidth = measure_copy_bandwidth(device)
        rows.append({"kernel": "copy", "case": "1 GiB", "impl": "torch", "GB/s": bandwidth / 1e9})
        print(f"copy bandwidth (read + written) {bandwidth / 1e9:.0f} GB/s")

    def record(
        kernel: str, case: str, impl: str, calls: list[Call], graph: bool = True, **extra
    ) -> None:
        """Times calls[0] eagerly and, on a GPU, all calls (rotating) in a CUDA graph; rates use
        the graph time when there is one."""
        row: dict = {"kernel": kernel, "case": case, "impl": impl}
        try:
            row["eager_ms"] = _time_eager(calls[0], device)
        except Exception as exc:  # one failing baseline must not lose the other rows
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        if graph and device.type == "cuda" and "error" not in row:
            try:
                row["graph_ms"] = _time_graph(calls)
            except Exception as exc:
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
        row.update(extra)
        ms = row.get("graph_ms", row.get("eager_ms"))
        if ms is not None and "bytes" in row:
            row["GB/s"] = row["bytes"] / ms / 1e6
            if bandwidth:
                row["of_copy_bandwidth"] = row["GB/s"] * 1e9 / bandwidth
        if ms is not None and "flops" in row:
            row["TFLOP/s"] = row["flops"] / ms / 1e9
            if row.get("fp8_peak_tflops"):
                row["fp8_peak_fraction"] = row["TFLOP/s"] / row["fp8_peak_tflops"]
        rows.append(row)
        _print_row(row)

    if only == "lora":
        _lora_rows(s, device, gen, record)
        return rows
    moe_shapes = moe_kernels.TINY if s is TINY else moe_kernels.QWEN3_30B_A3B
    if only == "moe":
        moe_kernels.moe_rows(moe_shapes, device, gen, record)
        return rows
    if only == "int4":
        _int4_rows(s, device, gen, record)
        return rows
    if only == "int8":
        _int8_rows(s, device, gen, record)
        return rows
    if only == "mla":
        mla_shapes = mla_kernels.TINY if s is TINY else mla_kernels.DEEPSEEK_V3
        mla_kernels.mla_rows(mla_shapes, device, gen, record, ROTATE_BYTES)
        return rows
    if only == "decode256":
        _decode256_rows(TINY_DECODE256 if s is TINY else GEMMA2_9B_DECODE, device, gen, record)
        return rows

    # --- decode attention: every sequence at the same context length ---------------------------
    for batch in s.decode_batches:
        for context in s.decode_contexts:
            case = f"batch={batch} ctx={context}"
            kv_bytes = 2 * batch * context * s.num_kv_heads * s.head_dim * elem
            copies = max(1, -(-ROTATE_BYTES // kv_bytes)) if device.type == "cuda" else 1
            k_cache, v_cache, all_tables = _paged([context] * batch, s, device, gen, copies)
            query = torch.randn(batch, s.num_heads, s.head_dim, generator=gen, device=device)
            query = query.to(s.dtype)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            all_args = [
                (query, k_cache, v_cache, tables, seq_lens, scale, context) for tables in all_tables
            ]
            expected = reference.paged_decode_attention(*all_args[0])
            err = _err(triton_ops.paged_decode_attention(*all_args[0]), expected)
            record("decode", case, "triton",
                   [lambda a=a: triton_ops.paged_decode_attention(*a) for a in all_args],
                   bytes=kv_bytes, max_abs_err=err)  # fmt: skip
            # The reference gathers the whole context: one copy is enough to be slow.
            record("decode", case, "reference",
                   [lambda a=all_args[0]: reference.paged_decode_attention(*a)],
                   bytes=kv_bytes)  # fmt: skip
            q4 = query[:, :, None, :]
            sdpa_calls = []
            for tables in all_tables:
                k4 = _contiguous_kv(k_cache, tables, context)
                v4 = _contiguous_kv(v_cache, tables, context)
                sdpa_calls.append(
                    lambda q=q4, k=k4, v=v4: F.scaled_dot_product_attention(
                        q, k, v, scale=scale, enable_gqa=True
                    )
                )
            record("decode", case, "sdpa_contiguous", sdpa_calls, bytes=kv_bytes)
            del k_cache, v_cache, all_args, sdpa_calls, expected

    # --- prefill attention: a whole prompt, and a chunk after a cached prefix -------------------
    for q_len, prefix in ((s.prefill_tokens, 0), (s.prefill_tokens // 4, s.prefix_tokens)):
        seq_len = q_len + prefix
        case = f"q_len={q_len} prefix={prefix}"
        k_cache, v_cache, (tables,) = _paged([seq_len], s, device, gen)
        query = torch.randn(q_len, s.num_heads, s.head_dim, generator=gen, device=device)
        query = query.to(s.dtype)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
        args = (query, k_cache, v_cache, tables, qsl, seq_lens, scale, q_len, seq_len)
        # QK^T and PV over the causal half of the new block plus the whole prefix.
        flops = 4 * s.num_heads * s.head_dim * q_len * (prefix + (q_len + 1) / 2)
        expected = reference.paged_prefill_attention(*args)
        err = _err(triton_ops.paged_prefill_attention(*args), expected)
        record("prefill", case, "triton", [lambda a=args: triton_ops.paged_prefill_attention(*a)],
               flops=flops, max_abs_err=err)  # fmt: skip
        # The reference reads lengths back to the host (.tolist()): it cannot be graph-captured.
        record("prefill", case, "reference",
               [lambda a=args: reference.paged_prefill_attention(*a)], graph=False,
               flops=flops)  # fmt: skip
        q4 = query.transpose(0, 1)[None].contiguous()  # [1, num_heads, q_len, head_dim]
        k4 = _contiguous_kv(k_cache, tables, seq_len)
        v4 = _contiguous_kv(v_cache, tables, seq_len)
        if prefix == 0:
            sdpa = lambda q=q4, k=k4, v=v4: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(prefix, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            sdpa = lambda q=q4, k=k4, v=v4, m=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=m, scale=scale, enable_gqa=True
            )
        record("prefill", case, "sdpa_contiguous", [sdpa], flops=flops)
        del k_cache, v_cache, k4, v4, expected

    # --- RMSNorm, rotary --------------------------------------------------------
    for tokens in s.norm_tokens:
        case = f"tokens={tokens}"
        kv_shape = (tokens, s.num_kv_heads, s.head_dim)
        key = torch.randn(kv_shape, generator=gen, device=device).to(s.dtype)
        value = torch.randn(kv_shape, generator=gen, device=device).to(s.dtype)
        k_cache, v_cache, _ = _paged([tokens], s, device, gen)
        slots = torch.randperm(tokens, generator=gen, device=device)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        x = torch.randn(tokens, s.hidden, generator=gen, device=device).to(s.dtype)
        residual = torch.randn(tokens, s.hidden, generator=gen, device=device).to(s.dtype)
        weight = torch.rand(s.hidden, generator=gen, device=device).to(s.dtype)
        norm_err = _err(triton_ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
        add_err = _err(
            triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)[0],
            reference.fused_add_rms_norm(x, residual, weight, 1e-5)[0],
        )
        for impl, ops in (("triton", triton_ops), ("reference", reference)):
            triton_only = impl == "triton"
            record("rms_norm", case, impl, [lambda o=ops, a=(x, weight): o.rms_norm(*a, 1e-5)],
                   bytes=2 * x.numel() * elem,
                   **({"max_abs_err": norm_err} if triton_only else {}))  # fmt: skip
            record("fused_add_rms_norm", case, impl,
                   [lambda o=ops, a=(x, residual, weight): o.fused_add_rms_norm(*a, 1e-5)],
                   bytes=4 * x.numel() * elem,
                   **({"max_abs_err": add_err} if triton_only else {}))  # fmt: skip

        q_shape = (tokens, s.num_heads, s.head_dim)
        query = torch.randn(q_shape, generator=gen, device=device).to(s.dtype)
        positions = torch.randint(0, 8192, (tokens,), generator=gen, device=device)
        inv_freq = 1.0 / 500000.0 ** (
            torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim
        )
        freqs = torch.outer(torch.arange(8192, device=device, dtype=torch.float32), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        rot_args = (positions, query, key, value, cos_sin)
        rot_err = _err(
            triton_ops.rotary_embedding_write_kv(*rot_args, k_cache, v_cache, slots),
            reference.rotary_embedding_write_kv(*rot_args, k_ref, v_ref, slots),
        )
        for impl, ops in (("triton", triton_ops), ("reference", reference)):
            record("rotary_write_kv", case, impl,
                   [lambda o=ops, a=(*rot_args, k_cache, v_cache, slots):
                    o.rotary_embedding_write_kv(*a)],
                   bytes=2 * (query.numel() + 2 * key.numel()) * elem,
                   **({"max_abs_err": rot_err} if impl == "triton" else {}))  # fmt: skip

    _lora_rows(s, device, gen, record)
    moe_kernels.moe_rows(moe_shapes, device, gen, record)
    return rows


def _decode256_rows(
    s: Shapes, device: torch.device, gen: torch.Generator, record: Callable
) -> None:
    """Decode over a float8 cache at Gemma-2-9B's shapes (GB/s of the K/V the step must read, and
    of_copy_bandwidth): its global (soft-capped) and sliding (soft-capped, windowed) layers at
    the tiles the engine chooses, the global layer at head_dim 128's tiles (`128-tiles`: what
    ran before rows of 256 dims had their own), and the same bytes at head_dim 128 (twice the
    context): a kernel as good at 256 dims as at 128 reads both at one rate."""
    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops
    from kiln.kernels.triton import decode_attention

    fp8 = torch.float8_e4m3fn
    wide = s.head_dim
    for batch, context in zip(s.decode_batches, s.decode_contexts, strict=True):
        for head_dim, ctx in ((wide, context), (wide // 2, 2 * context)):
            shapes = Shapes(s.num_heads, s.num_kv_heads, head_dim, 0, s.block_size, s.dtype,
                            (), (), 0, 0, (), 0, (0, 0, 0))  # fmt: skip
            kv_bytes = 2 * batch * ctx * s.num_kv_heads * head_dim  # one byte an element
            copies = max(1, -(-ROTATE_BYTES // kv_bytes)) if device.type == "cuda" else 1
            k_cache, v_cache, all_tables = _paged([ctx] * batch, shapes, device, gen, copies)
            k_cache, v_cache = k_cache.to(fp8), v_cache.to(fp8)
            query = torch.randn(batch, s.num_heads, head_dim, generator=gen, device=device)
            query = query.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            scale = head_dim**-0.5
            layers = [("global", None, False), ("sliding", GEMMA2_WINDOW, False)]
            if head_dim == wide:
                layers.append(("global 128-tiles", None, True))
            for layer, window, narrow_tiles in layers:
                if head_dim != wide and window is not None:
                    continue
                kinds = {"softcap": GEMMA2_SOFTCAP, "window": window}
                # The split count and grid paged_decode_attention chooses (for the record).
                keys = ctx if window is None else min(ctx, window)
                splits = decode_attention.choose_num_splits(
                    batch, s.num_kv_heads, keys, decode_attention.num_sms(device)
                )
                programs = batch * s.num_kv_heads * splits
                args = [(query, k_cache, v_cache, t, seq_lens, scale, ctx) for t in all_tables]
                wide_from = decode_attention._WIDE_HEAD_DIM
                if narrow_tiles:
                    decode_attention._WIDE_HEAD_DIM = 1 << 30
                try:
                    tiles = decode_attention._packed_tile_config(
                        s.block_size, device, programs, head_dim
                    )
                    err = _err(triton_ops.paged_decode_attention(*args[0], **kinds),
                               reference.paged_decode_attention(*args[0], **kinds))  # fmt: skip
                    record("decode256", f"b={batch} ctx={ctx} d={head_dim}", layer,
                           [lambda a=a, k=kinds: triton_ops.paged_decode_attention(*a, **k)
                            for a in args],
                           bytes=kv_bytes, max_abs_err=err, tiles=list(tiles), splits=splits,
                           programs=programs)  # fmt: skip
                finally:
                    decode_attention._WIDE_HEAD_DIM = wide_from
            del k_cache, v_cache, all_tables


def _lora_rows(s: Shapes, device: torch.device, gen: torch.Generator, record: Callable) -> None:
    """LoRA on the fused qkv and gate_up layers: shrink + expand over a step whose rows are spread
    over the adapters, beside the base layer's linear at the same rows. Adapters and base weights
    are rotated over copies spanning ROTATE_BYTES, as each layer of a model has its own."""
    tokens, num_slots, _ = s.lora
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    slots = (torch.randperm(tokens, generator=gen, device=device) % num_slots).to(torch.int32)
    x = torch.randn(tokens, s.hidden, generator=gen, device=device).to(s.dtype)
    for layer, bounds in (("qkv", (0, q, q + kv, q + 2 * kv)),
                          ("gate_up", (0, s.intermediate, 2 * s.intermediate))):  # fmt: skip
        _lora_layer(f"{layer} rows={tokens}", bounds, x, slots, s, device, gen, record)


def _int4_rows(s: Shapes, device: torch.device, gen: torch.Generator, record: Callable) -> None:
    """W4A16 (group 128) over a whole layer's four projections (qkv, o, gate_up, down) at 1, 8
    and 32 rows: int4_gemm's kernels against the sm_90 Gluon kernel over the re-laid codes
    (int4_gemm_hopper, run whether or not it is SELECTED), and int4_gemm's over the re-laid
    codes alone (triton_relaid: what a layer that keeps only that copy runs where the Gluon
    kernel does not apply), GB/s of codes."""
    from kiln.kernels import reference
    from kiln.kernels.int4_mma_layout import repack
    from kiln.kernels.triton import int4_gemm

    try:
        from kiln.kernels.triton import int4_gemm_hopper
    except ImportError:  # a Triton without Gluon: the old kernels' rows only
        int4_gemm_hopper = None  # type: ignore[assignment]
    group = 128 if s.hidden % 128 == 0 else 32
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes = ((q + 2 * kv, s.hidden), (q, q), (2 * s.intermediate, s.hidden),
              (s.hidden, s.intermediate))  # fmt: skip
    layer = []
    for n, k in shapes:
        codes = torch.randint(0, 16, (n, k), generator=gen, device=device)
        qweight = reference.pack_int4(codes)
        scales = torch.rand(n, k // group, generator=gen, device=device) * 0.01 + 0.001
        zeros = torch.full((n, k // group), 8.0, device=device)
        layer.append((qweight, scales, zeros, repack(qweight) if k % 64 == 0 else None))
    code_bytes = sum(n * k // 2 for n, k in shapes)
    for m in (1, 8, 32):
        xs = [torch.randn(m, k, generator=gen, device=device).to(s.dtype) for _, k in shapes]

        def old(xs: list[torch.Tensor] = xs) -> list[torch.Tensor]:
            return [int4_gemm.int4_linear(x, w, sc, z) for x, (w, sc, z, _) in zip(xs, layer)]

        def new(xs: list[torch.Tensor] = xs) -> list[torch.Tensor]:
            assert int4_gemm_hopper is not None
            return [int4_gemm_hopper.int4_linear_mma(x, r, sc, z)
                    for x, (_, sc, z, r) in zip(xs, layer)]  # fmt: skip

        def relaid(xs: list[torch.Tensor] = xs) -> list[torch.Tensor]:
            return [int4_gemm.int4_linear(x, None, sc, z, mma_weight=r)
                    for x, (_, sc, z, r) in zip(xs, layer)]  # fmt: skip

        want = [reference.int4_linear(x, w, sc, z) for x, (w, sc, z, _) in zip(xs, layer)]
        err = max(_err(g, w) for g, w in zip(old(), want))
        case = f"layer rows={m}"
        record("int4_w4a16", case, "triton", [old], bytes=code_bytes, max_abs_err=err)
        if all(r is not None for *_, r in layer) and not (
            int4_gemm_hopper is not None and int4_gemm_hopper.applies(xs[0], s.hidden, group)
        ):
            err = max(_err(g, w) for g, w in zip(relaid(), want))
            record("int4_w4a16", case, "triton_relaid", [relaid], bytes=code_bytes,
                   max_abs_err=err)  # fmt: skip
        if (
            int4_gemm_hopper is not None
            and all(r is not None for *_, r in layer)
            and (int4_gemm_hopper.supports(xs[0], s.hidden, group))
        ):
            err = max(_err(g, w) for g, w in zip(new(), want))
            record("int4_w4a16", case, "gluon_sm90", [new], bytes=code_bytes, max_abs_err=err)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the fused INT8 GEMM's configs the int8 rows
# force, besides the tiles int8_matmul picks (kept short: each one compiles).
INT8_CONFIGS = ((64, 128, 128, 4, 3), (64, 128, 128, 4, 4), (128, 128, 64, 4, 4),
                (128, 128, 128, 8, 3), (128, 256, 64, 8, 3))  # fmt: skip


def _int8_rows(s: Shapes, device: torch.device, gen: torch.Generator, record: Callable) -> None:
    """W8A8 INT8 over a whole layer's four projections (qkv, o, gate_up, down), operands already
    quantized (as the model's norms hand them over): int8_matmul as it selects (`selected`), its
    fused Triton kernel forced at each of INT8_CONFIGS (`triton`), torch._int_mm with the scale
    epilogue (`int_mm_epilogue`), and, the reference point, kiln's FP8 GEMM (fp8_gemm.fp8_matmul)
    on float8 operands of the same shapes (`fp8_scaled_mm`). GB/s of weights up to 64 rows,
    TFLOP/s above."""
    from kiln.kernels import reference
    from kiln.kernels.triton import fp8_gemm, int8_gemm

    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes = ((q + 2 * kv, s.hidden), (q, q), (2 * s.intermediate, s.hidden),
              (s.hidden, s.intermediate))  # fmt: skip

    def operands(size: tuple[int, int], scale: float) -> tuple[torch.Tensor, ...]:
        """(int8 codes, float8 values, [size[0]] fp32 scales) of this size."""
        codes = torch.randint(-127, 128, size, generator=gen, device=device).to(torch.int8)
        values = (torch.randn(size, generator=gen, device=device) * 64).to(torch.float8_e4m3fn)
        return codes, values, torch.rand(size[0], generator=gen, device=device) * scale + scale / 10

    weights = [operands((n, k), 1e-3) for n, k in shapes]
    weight_bytes = sum(n * k for n, k in shapes)
    cuda = device.type == "cuda"
    for m in (1, 16) if s is TINY else (1, 16, 64, 256, 512, 8192):
        xs = [operands((m, k), 1e-2) for _, k in shapes]
        int8_ops = [(x, xsc[:, None], w, wsc) for (x, _, xsc), (w, _, wsc) in zip(xs, weights)]
        fp8_ops = [(x, xsc[:, None], w, wsc) for (_, x, xsc), (_, w, wsc) in zip(xs, weights)]
        want = [reference.int8_matmul(*ops, None, s.dtype) for ops in int8_ops]
        fp8_want = [reference.fp8_matmul(*ops, None, s.dtype) for ops in fp8_ops]
        case = f"layer rows={m}"
        rate = {"bytes": weight_bytes} if m <= 64 else {"flops": 2 * m * weight_bytes}
        # int8_matmul's condition, less the shapes' (all multiples of 8).
        if cuda and m >= int8_gemm._CUBLAS_MIN_ROWS:
            selected = "torch._int_mm + scale epilogue"
        else:
            tiles = "/".join(map(str, int8_gemm._tiles(m)))
            selected = f"triton BLOCK {tiles}, Triton's default warps/stages"
        _layer_row(record, case, "selected", selected, int8_gemm.int8_matmul, int8_ops, want,
                   s.dtype, rate)  # fmt: skip
        for bm, bn, bk, warps, stages in INT8_CONFIGS:
            forced = functools.partial(int8_gemm._triton_int8_matmul, tiles=(bm, bn, bk),
                                       num_warps=warps, num_stages=stages)  # fmt: skip
            config = f"BLOCK {bm}/{bn}/{bk} warps={warps} stages={stages}"
            _layer_row(record, case, "triton", config, forced, int8_ops, want, s.dtype, rate)
        _layer_row(record, case, "int_mm_epilogue", "torch._int_mm (int32 [M, N]) + "
                   "_scale_epilogue", int8_gemm._cublas_int8_matmul, int8_ops, want, s.dtype,
                   rate)  # fmt: skip
        if not cuda:
            fp8 = "fp32 matmul + scale epilogue (no CUDA)"
        elif m >= fp8_gemm._ROWWISE_MIN_ROWS and s.dtype == torch.bfloat16:
            fp8 = "_scaled_mm, [M, 1] x [1, N] scales fused"
        else:
            fp8 = "_scaled_mm, unit scales, fp32 out + scale epilogue"
        _layer_row(record, case, "fp8_scaled_mm", fp8, fp8_gemm.fp8_matmul, fp8_ops, fp8_want,
                   s.dtype, rate)  # fmt: skip


def _layer_row(record: Callable, case: str, impl: str, config: str, matmul: Callable,
               operands: list, want: list[torch.Tensor], dtype: torch.dtype,
               rate: dict) -> None:  # fmt: skip
    """One int8_w8a8 row: matmul over each projection's (x, x_scale, weight, weight_scale),
    timed as one call; a matmul that raises gets record's error row."""

    def layer() -> list[torch.Tensor]:
        return [matmul(*ops, None, dtype) for ops in operands]

    extra = dict(rate)
    with contextlib.suppress(Exception):  # record's own call fails the same way: its error row
        extra["max_abs_err"] = max(_err(got, w) for got, w in zip(layer(), want))
    record("int8_w8a8", case, impl, [layer], config=config, **extra)


def _lora_layer(case: str, bounds: tuple[int, ...], x: torch.Tensor, slots: torch.Tensor,
                s: Shapes, device: torch.device, gen: torch.Generator,
                record: Callable) -> None:  # fmt: skip
    import torch.nn.functional as F

    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops

    tokens, num_slots, rank = s.lora
    case += f" {num_slots}x r{rank}"
    elem = torch.finfo(s.dtype).bits // 8
    n_out, slices = bounds[-1], len(bounds) - 1
    a_bytes, b_bytes = num_slots * rank * slices * s.hidden * elem, num_slots * rank * n_out * elem
    copies = max(1, ROTATE_BYTES // (a_bytes + b_bytes)) if device.type == "cuda" else 1
    adapters = [
        (torch.randn(num_slots, slices * rank, s.hidden, generator=gen, device=device)
         .mul(s.hidden**-0.5).to(s.dtype),
         torch.randn(num_slots, n_out, rank, generator=gen, device=device)
         .mul(rank**-0.5).to(s.dtype))
        for _ in range(copies)
    ]  # fmt: skip
    out = torch.randn(tokens, n_out, generator=gen, device=device).to(s.dtype)

    def lora(ops: ModuleType, a: torch.Tensor, b: torch.Tensor, o: torch.Tensor = out) -> None:
        ops.lora_expand(o, ops.lora_shrink(x, a, slots), b, slots, bounds)

    want, got = out.clone(), out.clone()
    lora(reference, *adapters[0], o=want)
    lora(triton_ops, *adapters[0], o=got)
    x_bytes, out_bytes = tokens * s.hidden * elem, tokens * n_out * elem
    # Unique bytes: x, every adapter once, out read and written.
    record("lora", case, "triton", [lambda a=a, b=b: lora(triton_ops, a, b) for a, b in adapters],
           bytes=a_bytes + b_bytes + x_bytes + 2 * out_bytes,
           max_abs_err=_err(got, want))  # fmt: skip
    # The rows grouped by adapter, as LoRAInputs orders a step's: 1-2 adapters a tile, not all.
    order = torch.sort(slots, stable=True).indices.to(torch.int32)
    record("lora", case, "triton_by_slot",
           [lambda a=a, b=b: triton_ops.lora_expand(
               out, triton_ops.lora_shrink(x, a, slots, None, order), b, slots, bounds, order)
            for a, b in adapters],
           bytes=a_bytes + b_bytes + x_bytes + 2 * out_bytes)  # fmt: skip
    record("lora", case, "triton_shrink",
           [lambda a=a: triton_ops.lora_shrink(x, a, slots) for a, _ in adapters],
           bytes=a_bytes + x_bytes)  # fmt: skip
    y = triton_ops.lora_shrink(x, adapters[0][0], slots)
    record("lora", case, "triton_expand",
           [lambda b=b: triton_ops.lora_expand(out, y, b, slots, bounds) for _, b in adapters],
           bytes=b_bytes + 2 * out_bytes)  # fmt: skip
    record("lora", case, "reference", [lambda: lora(reference, *adapters[0])],
           bytes=a_bytes + b_bytes + x_bytes + 2 * out_bytes)  # fmt: skip
    # The base layer at the same rows: a weight of its own per copy, as for the adapters.
    w_bytes = n_out * s.hidden * elem
    copies = max(1, ROTATE_BYTES // w_bytes) if device.type == "cuda" else 1
    weights = [torch.randn(n_out, s.hidden, generator=gen, device=device).to(s.dtype)
               for _ in range(copies)]  # fmt: skip
    record("lora", case, "base_linear", [lambda w=w: F.linear(x, w) for w in weights],
           bytes=w_bytes + x_bytes + out_bytes)  # fmt: skip


@dataclass(frozen=True)
class LongShapes:
    """The long-context rows: one causal prompt (the engine's paged cache, block size 16) and
    float8 decode at long contexts."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    prompt_tokens: int
    decode_cases: tuple[tuple[int, int], ...]  # (batch, context)
    # Tiles tried for each operand kind on top of prefill_attention.PREFILL_TILES' choice.
    tile_sweep: tuple[tuple[int, int, int, int], ...]


LLAMA_8B_LONG = LongShapes(32, 8, 128, 16, 16384, ((1, 4096), (1, 32768), (1, 131072), (64, 4096)),
                           ((128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3),
                            (128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 4, 3)))  # fmt: skip
TINY_LONG = LongShapes(4, 2, 32, 4, 40, ((1, 40), (3, 24)), ())  # float8 dots: head_dim >= 32


def run_long(s: LongShapes, device: torch.device) -> list[dict]:
    """Prefill attention of one causal prompt over the paged cache: a bf16 cache, a float8 cache
    widened to 16-bit dots, with float8 Q @ K^T, and with float8 P @ V too (TFLOP/s, causal
    FLOPs 2 * 2 * S * S / 2 * heads * head_dim), beside torch's SDPA (FlashAttention on Hopper)
    on the same shape, contiguous, bf16; then float8 decode at long contexts (GB/s of K/V, and
    its fraction of the copy bandwidth measured here)."""
    import torch.nn.functional as F

    from kiln.bench.report import measure_copy_bandwidth
    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops
    from kiln.kernels.triton import prefill_attention, prefill_attention_hopper

    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    fp8 = torch.float8_e4m3fn
    scale = s.head_dim**-0.5
    bandwidth = measure_copy_bandwidth(device) if device.type == "cuda" else 0.0

    def record(kernel: str, case: str, impl: str, calls: list[Call], **extra) -> dict:
        row: dict = {"kernel": kernel, "case": case, "impl": impl, **extra}
        try:
            row["eager_ms"] = _time_eager(calls[0], device)
            if device.type == "cuda":
                row["graph_ms"] = _time_graph(calls)
        except Exception as exc:  # one failing variant must not lose the other rows
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        ms = row.get("graph_ms", row.get("eager_ms"))
        if ms is not None and "flops" in row:
            row["TFLOP/s"] = row["flops"] / ms / 1e9
        if ms is not None and "bytes" in row:
            row["GB/s"] = row["bytes"] / ms / 1e6
            if bandwidth:
                row["of_copy_bandwidth"] = row["GB/s"] * 1e9 / bandwidth
        rows.append(row)
        _print_row(row)
        return row

    if bandwidth:
        rows.append({"kernel": "copy", "case": "1 GiB", "impl": "torch", "GB/s": bandwidth / 1e9})
        print(f"copy bandwidth (read + written) {bandwidth / 1e9:.0f} GB/s")

    # --- prefill: one causal prompt -----------------------------------------------------------
    n = s.prompt_tokens
    case = f"causal S={n}"
    flops = 2 * 2 * n * n / 2 * s.num_heads * s.head_dim
    shapes = Shapes(s.num_heads, s.num_kv_heads, s.head_dim, 0, s.block_size, torch.bfloat16,
                    (), (), 0, 0, (), 0, (0, 0, 0))  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k16, v16, (tables,) = _paged([n], shapes, device, gen)
    k16, v16 = k16.to(dtype), v16.to(dtype)
    query = torch.randn(n, s.num_heads, s.head_dim, generator=gen, device=device).to(dtype)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    rest = (tables, qsl, lens, scale, n, n)
    k8, v8 = k16.to(fp8), v16.to(fp8)
    widened = reference.paged_prefill_attention(query, k8, v8, *rest)
    variants = (
        ("bf16 cache", k16, v16, False, "bf16"),
        ("fp8 cache, widened", k8, v8, False, "fp8_widened"),
        ("fp8 cache, fp8 QK", k8, v8, True, "fp8_qk"),
    )
    # The Triton kernel by name (the entry point hands the calls that
    # prefill_attention_hopper.applies() selects to the Gluon kernel, timed in its own row below).
    triton_prefill = prefill_attention.triton_paged_prefill_attention
    for impl, k_cache, v_cache, dots, operands in variants:
        args = (query, k_cache, v_cache, *rest)
        expected = widened if k_cache.dtype == fp8 else reference.paged_prefill_attention(*args)
        out = triton_prefill(*args, fp8_qk=dots)
        err = _err(out, expected)
        rel = float((out.float() - expected.float()).norm() / expected.float().norm())
        key = (128 if s.head_dim <= 128 else 256, operands)
        chosen = prefill_attention.PREFILL_TILES[key]
        for tiles in (chosen, *[t for t in s.tile_sweep if t != chosen]):
            prefill_attention.PREFILL_TILES[key] = tiles
            try:
                record("prefill_long", case, impl,
                       [lambda a=args, d=dots: triton_prefill(*a, fp8_qk=d)],
                       flops=flops, tiles=list(tiles), chosen=tiles == chosen,
                       max_abs_err=err, rel_err=rel)  # fmt: skip
            finally:
                prefill_attention.PREFILL_TILES[key] = chosen
        if prefill_attention_hopper.supports(query, k_cache, fp8_qk=dots):
            # The Gluon sm_90 kernel (TMA, wgmma, warp-specialised) where it runs: its two
            # attention warpgroups as partitions of their own (the default), then as one.
            chosen_consumers = prefill_attention_hopper.CONSUMERS
            for consumers in (chosen_consumers, 3 - chosen_consumers):
                prefill_attention_hopper.CONSUMERS = consumers
                try:
                    out = prefill_attention_hopper.paged_prefill_attention(*args, fp8_qk=dots)
                    rel = float((out.float() - expected.float()).norm() / expected.float().norm())
                    record("prefill_long", case, f"{impl}, sm90 gluon",
                           [lambda a=args, d=dots: prefill_attention_hopper.paged_prefill_attention(
                               *a, fp8_qk=d)],
                           flops=flops, consumers=consumers, chosen=consumers == chosen_consumers,
                           max_abs_err=_err(out, expected), rel_err=rel)  # fmt: skip
                except Exception as exc:  # a compile error loses this row only
                    rows.append({"kernel": "prefill_long", "case": case, "impl": "sm90 gluon",
                                 "consumers": consumers, "error": repr(exc)[:300]})  # fmt: skip
                    _print_row(rows[-1])
                finally:
                    prefill_attention_hopper.CONSUMERS = chosen_consumers
    q4 = query.transpose(0, 1)[None].contiguous()
    k4, v4 = _contiguous_kv(k16, tables, n), _contiguous_kv(v16, tables, n)
    record("prefill_long", case, "sdpa_contiguous_bf16",
           [lambda q=q4, k=k4, v=v4: F.scaled_dot_product_attention(
               q, k, v, is_causal=True, scale=scale, enable_gqa=True)],
           flops=flops)  # fmt: skip
    del k16, v16, k8, v8, k4, v4, q4, widened

    # --- decode over a float8 cache at long contexts -------------------------------------------
    for batch, context in s.decode_cases:
        case = f"fp8 batch={batch} ctx={context}"
        kv_bytes = 2 * batch * context * s.num_kv_heads * s.head_dim  # one byte an element
        copies = max(1, -(-ROTATE_BYTES // kv_bytes)) if device.type == "cuda" else 1
        k_cache, v_cache, all_tables = _paged([context] * batch, shapes, device, gen, copies)
        k_cache, v_cache = k_cache.to(fp8), v_cache.to(fp8)
        query = torch.randn(batch, s.num_heads, s.head_dim, generator=gen, device=device)
        query = query.to(dtype)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        all_args = [(query, k_cache, v_cache, t, seq_lens, scale, context) for t in all_tables]
        err = _err(triton_ops.paged_decode_attention(*all_args[0]),
                   reference.paged_decode_attention(*all_args[0]))  # fmt: skip
        record("decode_long", case, "triton",
               [lambda a=a: triton_ops.paged_decode_attention(*a) for a in all_args],
               bytes=kv_bytes, max_abs_err=err)  # fmt: skip
        del k_cache, v_cache, all_args
    return rows


def _print_row(row: dict) -> None:
    def us(key: str) -> str:
        return f"{row[key] * 1e3:10.1f}" if key in row else f"{'-':>10}"

    if "error" in row:
        print(f"{row['kernel']:<19}{row['case']:<24}{row['impl']:<16}  ERROR {row['error']}")
        return
    timing = us("eager_ms") + us("graph_ms")
    rate = ""
    if "GB/s" in row:
        rate = f"{row['GB/s']:9.1f} GB/s"
    elif "TFLOP/s" in row:
        rate = f"{row['TFLOP/s']:9.2f} TFLOP/s"
        if "fp8_peak_fraction" in row:
            rate += f" ({row['fp8_peak_fraction']:.0%} of {row['fp8_peak_tflops']:.0f} FP8 peak)"
    err = f"  err={row['max_abs_err']:.2e}" if "max_abs_err" in row else ""
    tiles = f"  tiles={row['tiles']}" if "tiles" in row else ""
    if "config" in row:
        tiles += f"  {row['config']}"
    if "consumers" in row:
        tiles += f"  consumers={row['consumers']}"
    print(f"{row['kernel']:<19}{row['case']:<24}{row['impl']:<16}{timing}{rate:>18}{err}{tiles}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where to write the JSON results")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny fp32 shapes (a smoke run; CPU interpreter)"
    )
    parser.add_argument(
        "--only",
        choices=("lora", "moe", "int4", "int8", "mla", "decode256"),
        help="these rows only (default: all but int4, int8, mla and decode256)",
    )
    parser.add_argument(
        "--long", action="store_true", help="the long-context rows: 16k prefill, decode to 128k"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.tiny:
            parser.error("no CUDA GPU: only --tiny runs here (under the Triton interpreter)")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes: Shapes | LongShapes = TINY if args.tiny else LLAMA_8B
    if args.long:
        shapes = TINY_LONG if args.tiny else LLAMA_8B_LONG
    import triton

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"{gpu}; torch {torch.__version__}; triton {triton.__version__}")
    print(f"{'kernel':<19}{'case':<24}{'impl':<16}{'eager us':>10}{'graph us':>10}{'rate':>18}")
    with torch.inference_mode():
        if isinstance(shapes, LongShapes):
            rows = run_long(shapes, device)
        else:
            rows = run(shapes, device, args.only)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git_revision": _git_revision(),
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {k: str(v) for k, v in shapes.__dict__.items()},
        "results": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
