"""The kernel tile choices an engine will run with on the build's GPU class, for the manifest and
`kiln build`'s output: the small-batch linear kernels' launch shapes at the model's projection
shapes (kiln.kernels.triton.small_batch_tiles: a measured entry, or the rule) and decode
attention's tile and split-K policy.

A record, not a tuning: the kernels choose their tiles at run time with these same functions, so
the record says what runs on a GPU of this class (with this kiln) and where each choice came
from. Without a GPU the kernels that run are PyTorch's, and a GPU that loads the engine later
chooses for itself: nothing is recorded, with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.models.config import ModelConfig

CPU_REASON = (
    "built without a GPU: the Triton kernels choose their tiles on the GPU that runs the engine "
    "(kiln.kernels.triton.small_batch_tiles, decode_attention), none were chosen at build time"
)
# The block size the runtime's KV cache uses unless told otherwise (EngineConfig.block_size):
# decode attention's tile depends on it.
_DEFAULT_BLOCK_SIZE = 16


def _projections(cfg: ModelConfig) -> dict[str, tuple[int, int, tuple[tuple[str, int], ...]]]:
    """Projection -> (weight rows, K, ((kernel, rows of input), ...)): which small-batch kernel
    serves it at one row (fused with what comes before it) and at 2-8 rows."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv, inter = cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "qkv_proj": (q + 2 * kv, h, (("qkv_rotary", 1), ("linear", 8))),
        "o_proj": (h, q, (("linear", 1), ("linear", 8))),
        "gate_up_proj": (2 * inter, h, (("norm_linear_silu_mul", 1), ("linear_silu_mul", 8))),
        "down_proj": (h, inter, (("linear", 1), ("linear", 8))),
    }


def kernel_tiles(
    cfg: ModelConfig,
    quantization: str,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
    gpu_class: str | None,
) -> tuple[dict[str, Any] | None, str | None]:
    """(the tile table that applies, None) on a GPU; (None, why) without one."""
    if device.type != "cuda":
        return None, CPU_REASON
    from kiln.kernels.triton import decode_attention, small_batch_tiles
    from kiln.kernels.triton.decode_attention import _tile_config

    element_bytes = 1 if quantization != "none" else dtype.itemsize
    linear = []
    for proj, (n, k, launches) in _projections(cfg).items():
        for kernel, rows in launches:
            key = (kernel, n, k, element_bytes, rows == 1)
            origin = "measured" if key in small_batch_tiles.MEASURED_TILES else "rule"
            tiles = small_batch_tiles.tile_config(kernel, n, k, device, element_bytes, rows)
            linear.append({
                "projection": proj, "kernel": kernel, "rows": "1" if rows == 1 else "2-8",
                "n": n, "k": k, "element_bytes": element_bytes, "tiles": tiles._asdict(),
                "from": origin,
            })  # fmt: skip
    kv_fp8 = kv_cache_dtype.itemsize == 1  # float8 or int8: the one-byte caches' tiles
    block_n, num_warps, num_stages = _tile_config(_DEFAULT_BLOCK_SIZE, device, kv_fp8)
    # From this many programs (sequences x KV heads x splits) a float8 cache's kernel runs
    # one-warp programs instead (decode_attention._tile_config).
    one_warp_from = (
        decode_attention._FP8_ONE_WARP_PROGRAMS_PER_SM * small_batch_tiles.num_sms(device)
        if kv_fp8
        else None
    )
    return {
        "gpu_class": gpu_class,
        "num_sms": small_batch_tiles.num_sms(device),
        "small_batch_linear": linear,
        "decode_attention": {
            "block_size": _DEFAULT_BLOCK_SIZE,
            "kv_cache_float8": kv_fp8,
            "block_n": block_n,
            "num_warps": num_warps,
            "num_stages": num_stages,
            "prefetch_fp8_v": True if kv_fp8 else None,  # V a tile ahead over float8
            "one_warp_32_keys_from_programs": one_warp_from,
            "split_k": {
                "target_programs_per_sm": decode_attention._TARGET_PROGRAMS_PER_SM,
                "min_tokens_per_split": decode_attention._MIN_TOKENS_PER_SPLIT,
                "max_splits": decode_attention._MAX_SPLITS,
            },
        },
    }, None


def describe(tiles: dict[str, Any] | None, reason: str | None) -> str:
    """The table in a few lines, for `kiln build`'s output."""
    if tiles is None:
        return f"kernel tiles: none recorded ({reason or 'built by a kiln that records none'})"
    lines = [f"kernel tiles ({tiles['gpu_class']}, {tiles['num_sms']} SMs):"]
    for e in tiles["small_batch_linear"]:
        t = e["tiles"]
        split = f" split-k {t['split_k']}" if t["split_k"] > 1 else ""
        lines.append(
            f"  {e['projection']:<13} rows {e['rows']:<3} {e['kernel']:<21} {e['n']}x{e['k']}: "
            f"{t['block_n']}x{t['block_k']} {t['num_warps']} warps {t['num_stages']} stages"
            f"{split} ({e['from']})"
        )
    d = tiles["decode_attention"]
    lines.append(
        f"  decode attention ({'float8' if d['kv_cache_float8'] else 'model-dtype'} cache, block "
        f"{d['block_size']}): {d['block_n']} keys/tile {d['num_warps']} warps "
        f"{d['num_stages']} stages; split-K up to {d['split_k']['max_splits']}"
        + (
            f"; 32 keys/tile 1 warp from {d['one_warp_32_keys_from_programs']} programs"
            if d.get("one_warp_32_keys_from_programs")
            else ""
        )
    )
    return "\n".join(lines)
