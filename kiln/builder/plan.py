"""The memory plan of an engine, from its config alone: printed before anything is loaded, so a
build (or a model) that cannot fit says so in a second, not after minutes of loading. It is the
runtime's config plan (kiln.runtime.config_plan) at the engine's default knobs, so a hybrid
model's windowed layer groups are counted at their window here as at load."""

from __future__ import annotations

import torch

from kiln.models.config import ModelConfig
from kiln.runtime.config_plan import ConfigPlan, plan_from_config, weight_bytes

__all__ = ["plan_memory", "weight_bytes"]


def plan_memory(
    cfg: ModelConfig,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    quantization: str,
    max_model_len: int,
    device: torch.device,
) -> ConfigPlan:
    """On the CPU the runtime's default KV budget; on CUDA what the engine's default
    gpu_memory_utilization of the card leaves after the weights, the activation estimate and
    the runtime's reserve, in its default blocks and step (the profiled plan at load replaces
    it)."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return plan_from_config(
        cfg, None, max_model_len, dtype, kv_dtype, total, quantization=quantization
    )
