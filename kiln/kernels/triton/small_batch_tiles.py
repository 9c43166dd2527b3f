"""The small-batch linear kernels' launch shapes, chosen in one place: the tiles, the pipeline
depth and the split-K factor of every launch of small_batch_linear's and qkv_rotary's kernels.

A measured entry (MEASURED_TILES, written from the small-batch tile tuner's GPU sweeps) wins;
otherwise the rule below, fitted to the bf16 sweeps, with no split (one program per tile).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from kiln.kernels.triton._device import num_sms

# The kernels, as the table names them: the plain projection (`linear`, also the 2-8 row float8
# projection after quantize_fp8), its gated form (SiLU-mul after gate_up), the one-row kernels
# with the residual add and RMSNorm fused before (`norm_*`), and the attention block's one-row
# kernel (norm, qkv, rotary, KV write).
KERNELS = ("linear", "linear_silu_mul", "norm_linear", "norm_linear_silu_mul", "qkv_rotary")
NORM_KERNELS = ("norm_linear", "norm_linear_silu_mul", "qkv_rotary")


class Tiles(NamedTuple):
    """One launch's shape. A gated or qkv kernel's program streams block_n // 2 rows of each
    half (the launcher halves it on the GPU), so the bytes per step are block_n rows' either way.
    """

    block_n: int  # weight rows per program
    block_k: int  # K per step of the weight stream
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs per output tile, over K slices (split_k.py); 1: none
    stats_block: int = 0  # K per step of the pass over the input row before the stream (the
    # absmax of a dynamic activation scale, RMSNorm's sum of squares); 0: block_k


# (kernel, weight rows, K, weight element bytes, one row) -> Tiles, from the tile tuner's GPU
# sweeps, every configuration checked against a reference on the GPU. Llama-3.1-8B's float8
# projections: batch-1 decode 256.5 -> 314.9 tok/s on an H200 with them; the one-row entries
# retimed for the dot with the weight tile first (small_batch_linear._times), static scales,
# batch 1 282.2 -> 291.5 tok/s on an H100. Times are us per call on that H100, the tiles before
# in brackets. The 2-8 row qkv keeps the rule.
MEASURED_TILES: dict[tuple[str, int, int, int, bool], Tiles] = {
    # qkv + rotary + KV write, one row: 13.9 us (the same tiles: 32 pairs of rows a half are too
    # few for the swapped dot, and 64 were no faster, 14.0)
    ("qkv_rotary", 6144, 4096, 1, True): Tiles(64, 256, 4, 3, split_k=4, stats_block=2048),
    # o_proj, one row: 9.0 us (9.4); 2-8 rows: 10.8 at 8 rows (11.3 with the plain dot)
    ("linear", 4096, 4096, 1, True): Tiles(128, 256, 4, 3, split_k=4, stats_block=1024),
    ("linear", 4096, 4096, 1, False): Tiles(64, 256, 4, 4, split_k=4, stats_block=0),
    # gate_up (norm, SiLU-mul), one row: 44.9 us (46.9, 64 x 256 unsplit: 32 rows a half)
    ("norm_linear_silu_mul", 28672, 4096, 1, True): Tiles(128, 256, 4, 3, stats_block=1024),
    # down, one row: 23.4 us (24.2); 2-8 rows: 28.7 at 8 rows (29.3 with the plain dot)
    ("linear", 4096, 14336, 1, True): Tiles(64, 256, 4, 3, split_k=4, stats_block=1024),
    ("linear", 4096, 14336, 1, False): Tiles(64, 256, 4, 4, split_k=4, stats_block=0),
}


# Outlier columns (quantization/outlier_columns.py) append 16-128 remainder columns to a
# projection's K; such a launch takes the tiles measured for K itself (without them, the rule's
# unsplit tiles ran a one-row o_proj at K + 16 in 10.3 us on an H200 against 6.8 for the plain
# projection).
MAX_EXTRA_COLUMNS = 128


def _measured(kernel: str, n: int, k: int, element_size: int, one_row: bool) -> Tiles | None:
    """The table's entry for this launch, or for the largest K up to MAX_EXTRA_COLUMNS below k
    with everything else equal."""
    near = [
        (key_k, tiles)
        for (key_kernel, key_n, key_k, key_size, key_one_row), tiles in MEASURED_TILES.items()
        if (key_kernel, key_n, key_size, key_one_row) == (kernel, n, element_size, one_row)
        and k - MAX_EXTRA_COLUMNS <= key_k <= k
    ]
    return max(near)[1] if near else None


def tile_config(
    kernel: str, n: int, k: int, device: torch.device, element_size: int = 2, rows: int = 1
) -> Tiles:
    """The launch shape for `kernel` over an [n, k] weight of element_size bytes and `rows`
    input rows (a gated kernel's n counts both halves)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown small-batch kernel {kernel!r}; known: {', '.join(KERNELS)}")
    if device.type != "cuda":
        return Tiles(16, 32, 4, 1)  # the interpreter: small tiles, every masking path exercised
    measured = _measured(kernel, n, k, element_size, rows == 1)
    if measured is not None:
        return measured
    # As many columns per program as still leave about one program per SM. H200 sweeps at
    # Llama-3.1-8B shapes: plain, 32 KiB weight tiles in 4 stages (o_proj, down: 32 x 512); with
    # the norm fused, 3 stages, and 128-wide K steps when the programs outnumber the SMs (qkv
    # 64 x 256: 17.2 us; gate_up 64 x 128: 57.5 us).
    sms = num_sms(device)
    block_n = 64 if triton.cdiv(n, 64) >= 0.7 * sms else 32
    block_k = 32768 // (block_n * element_size)
    if kernel not in NORM_KERNELS:
        return Tiles(block_n, block_k, 4, 4 if triton.cdiv(n, block_n) <= sms else 3)
    if triton.cdiv(n, block_n) > sms:
        block_k //= 2
    return Tiles(block_n, block_k, 4, 3)
