"""The bytes one decode step must read, the floor of time per output token: every weight a
token runs through (the embedding table only gathered from) and the context's KV. A
mixture-of-experts layer runs only the experts its tokens pick: at batch B with top-k of E
experts, routed uniformly and independently, a layer touches E * (1 - (1 - k / E)^B) distinct
experts on average, so only those experts' bytes count (Qwen3-30B-A3B at batch 1: 8 of 128)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kiln.models.config import ModelConfig


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Experts of one layer that `batch` tokens, each picking `top_k` of `num_experts`
    uniformly, touch on average."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class DecodeStepBytes:
    non_expert_bytes: float  # every weight but the routed experts and a gather-only embedding
    expert_bytes: float  # the routed experts a step is expected to read
    kv_bytes: float  # the context's K and V
    experts_per_layer: float  # distinct experts a sparse layer is expected to read
    active_parameters: int  # parameters one token runs through (its top-k experts only)
    total_parameters: int

    @property
    def total_bytes(self) -> float:
        return self.non_expert_bytes + self.expert_bytes + self.kv_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_per_step": self.total_bytes}


def decode_step_bytes(
    cfg: ModelConfig,
    weight_bytes: int,  # every parameter's bytes as loaded (MemoryPlan.weight_bytes)
    expert_weight_bytes: int,  # of which the routed experts' (MemoryPlan.expert_weight_bytes)
    embedding_bytes: int,  # of which an untied embedding table's (gathered, never streamed)
    kv_bytes: float,  # the context's KV bytes one step reads
    batch: int,  # sequences decoding together
) -> DecodeStepBytes:
    """A decode step's bytes for `batch` sequences (see the module docstring)."""
    counts = cfg.parameter_counts()
    total_params = sum(counts.values())
    sparse_layers = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    per_expert_params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = sparse_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert_params
    touched = 0.0
    expert_bytes = 0.0
    if sparse_layers and expert_weight_bytes:
        touched = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
        expert_bytes = expert_weight_bytes * touched / cfg.num_experts
    return DecodeStepBytes(
        non_expert_bytes=float(weight_bytes - expert_weight_bytes - embedding_bytes),
        expert_bytes=expert_bytes,
        kv_bytes=float(kv_bytes),
        experts_per_layer=touched,
        active_parameters=total_params - idle,
        total_parameters=total_params,
    )
