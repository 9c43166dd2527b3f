"""The memory plan of an engine, from its config alone: printed before anything is loaded, so a
build (or a model) that cannot fit says so in a second, not after minutes of loading."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.models.config import ModelConfig
from kiln.runtime.config_plan import weight_bytes
from kiln.runtime.memory_plan import _CPU_DEFAULT_KV_GB, GiB, kv_bytes_per_token

__all__ = ["BuildMemoryPlan", "plan_memory", "weight_bytes"]


@dataclass(frozen=True)
class BuildMemoryPlan:
    weight_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    max_model_len: int
    target: str  # "cpu" or the GPU's name

    @property
    def kv_tokens(self) -> int:
        return self.kv_budget_bytes // self.kv_bytes_per_token

    @property
    def max_sequences(self) -> int:
        return self.kv_tokens // self.max_model_len

    def describe(self) -> str:
        return (
            f"memory plan ({self.target}): weights {self.weight_bytes / GiB:.2f} GiB; KV cache "
            f"{self.kv_bytes_per_token / 1024:.1f} KiB/token, {self.kv_budget_bytes / GiB:.2f} "
            f"GiB = {self.kv_tokens} tokens: {self.max_sequences} sequences of "
            f"{self.max_model_len} tokens at once"
        )


def plan_memory(
    cfg: ModelConfig,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    quantization: str,
    max_model_len: int,
    device: torch.device,
    gpu_memory_utilization: float = 0.9,
) -> BuildMemoryPlan:
    """On the CPU the runtime's default KV budget; on CUDA what `gpu_memory_utilization` of the
    card leaves after the weights (the runtime also reserves activations and graphs: this is the
    upper bound)."""
    weights = weight_bytes(cfg, dtype, quantization)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = max(0, int(total * gpu_memory_utilization) - weights)
        target = torch.cuda.get_device_name(device)
    else:
        budget, target = int(_CPU_DEFAULT_KV_GB * GiB), "cpu"
    return BuildMemoryPlan(
        weights, kv_bytes_per_token(cfg, kv_dtype), budget, max_model_len, target
    )
