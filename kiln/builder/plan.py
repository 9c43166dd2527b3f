"""The memory plan of an engine, from its config alone: printed before anything is loaded, so a
build (or a model) that cannot fit says so in a second, not after minutes of loading."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.models.config import ModelConfig
from kiln.runtime.memory_plan import _CPU_DEFAULT_KV_GB, GiB, kv_bytes_per_token

_FP8_BYTES = 1


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


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str) -> int:
    """Bytes of the parameters kiln creates for `cfg`. Quantized: the projections' weights take
    one byte each plus a float32 scale per output channel; embedding, norms and LM head stay in
    `dtype`. A sparse layer counts every expert (float8 with a float32 scale per expert and
    projection under "fp8-dynamic", else in `dtype`: static FP8 leaves them), its router in
    `dtype`, and its shared expert as a dense MLP's projections."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv, layers = cfg.num_key_value_heads * cfg.head_dim, range(cfg.num_hidden_layers)
    projections = [(h, q + 2 * kv), (q, h)] * cfg.num_hidden_layers  # (in, out)
    experts = routers = 0
    for i in layers:
        sparse = cfg.is_sparse_layer(i)
        inter = cfg.shared_expert_intermediate_size if sparse else cfg.intermediate_size
        if inter:
            projections += [(h, 2 * inter), (inter, h)]
        if sparse:  # the rest of its MLP: the router (and the shared expert's gate row)
            routed = cfg.num_experts * 3 * h * cfg.moe_intermediate_size
            experts += routed
            routers += cfg.mlp_parameter_count(i) - routed - 3 * h * inter
    float8_experts = quantization == "fp8-dynamic"
    sparse_layers = sum(cfg.is_sparse_layer(i) for i in layers)
    expert_bytes = (
        experts * _FP8_BYTES + sparse_layers * 2 * cfg.num_experts * 4
        if float8_experts
        else experts * dtype.itemsize
    )
    linear = sum(i * o for i, o in projections)
    out_channels = sum(o for _, o in projections)
    bias = (q + 2 * kv) * cfg.num_hidden_layers if cfg.attention_bias else 0
    norms = (2 * cfg.num_hidden_layers + 1) * h
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    other = (bias + norms + embeddings + routers) * dtype.itemsize + expert_bytes
    if quantization == "none":
        return linear * dtype.itemsize + other
    return linear * _FP8_BYTES + out_channels * 4 + other


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
