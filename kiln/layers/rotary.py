"""Rotary position embedding tables, including Llama 3's frequency scaling."""

from __future__ import annotations

import math

import torch

from kiln.errors import ModelLoadError


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them (fp32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError(
        f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between them
    # interpolated smoothly.
    factor = float(cfg["factor"])
    low_freq_factor = float(cfg["low_freq_factor"])
    high_freq_factor = float(cfg["high_freq_factor"])
    old_context_len = float(cfg["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def build_cos_sin_cache(
    head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None
) -> torch.Tensor:  # [max_positions, head_dim] fp32: cos(half) then sin(half)
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
