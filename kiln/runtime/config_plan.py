"""The memory plan from a model's config alone, before any weight is read: how many sequences of
each length the KV cache will hold. The runtime's own plan (memory_plan.plan_kv_blocks) profiles
a real step after loading and is what the engine uses; this one is arithmetic, so a long-context
setup that cannot fit says so in a second, and `kiln build` prints it too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.config import EngineConfig
from kiln.models.config import ModelConfig
from kiln.models.mla_config import mla_attention_shapes, mla_unquantized_count
from kiln.models.moe_config import PER_CHANNEL_8BIT, ROW_BLOCK_8BIT, expert_scale_count
from kiln.runtime.fits import fits_text, report_lengths
from kiln.runtime.memory_plan import (
    _CPU_DEFAULT_KV_GB,
    GiB,
    GroupPlan,
    group_plans,
    kv_bytes_per_token,
    seq_blocks,
    step_blocks,
)

_FP8_BYTES = 1
# What profiling adds beyond the step's tensors on a GPU (the runtime's _SAFETY_MARGIN plus the
# decode graphs' pool floor, kiln.runtime.memory_plan): a fixed allowance here.
_FIXED_RESERVE = GiB // 2 + 256 * (1 << 20)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, quantization: str) -> int:
    """Bytes of the parameters kiln creates for `cfg`. Quantized: the projections' weights take
    one byte each plus a float32 scale per output channel; embedding, norms and LM head stay in
    `dtype`. A sparse layer counts every expert (float8 with a float32 scale per expert and
    projection, or per output channel, under "fp8-dynamic", else in `dtype`: static FP8 leaves
    them), its router (and gpt-oss's experts' biases) in `dtype`, and its shared expert as a
    dense MLP's projections; gpt-oss's attention sinks and sigmoid routers (and biases) in fp32
    ("fp8-block": the experts float8 with a scale per row and 128 inputs; "int4-*": half a byte
    each, an fp32 scale and zero per row and group; 8-bit weight-only and W8A8 INT8: a byte each
    and an fp32 scale per row, kiln.layers.moe_w8a16). A rank's shard_config counts the experts
    it holds (expert parallelism) or their slices (tensor parallelism)."""
    h, q = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv, layers = cfg.num_key_value_heads * cfg.head_dim, range(cfg.num_hidden_layers)
    projections = [(h, q + 2 * kv), (q, h)] * cfg.num_hidden_layers  # (in, out)
    mla = 0  # MLA's parameters in `dtype` whatever the quantization (kiln.models.mla)
    if cfg.kv_lora_rank:
        projections = mla_attention_shapes(cfg) * cfg.num_hidden_layers
        mla = mla_unquantized_count(cfg) * cfg.num_hidden_layers
    experts = routers = sinks = 0  # sinks: fp32 parameters (attention sinks, routing biases)
    for i in layers:
        sparse = cfg.is_sparse_layer(i)
        inter = cfg.shared_expert_intermediate_size if sparse else cfg.intermediate_size
        if inter:
            projections += [(h, 2 * inter), (inter, h)]
        if sparse:  # the rest of its MLP: the router (and the shared expert's gate row)
            routed = cfg.num_held_experts * 3 * h * cfg.moe_intermediate_size
            experts += routed
            routers += cfg.mlp_parameter_count(i) - routed - 3 * h * inter
            if cfg.moe_routing == "sigmoid":  # its router and routing bias fp32, counted below
                routers -= cfg.num_experts * (h + 1)
                sinks += cfg.num_experts * (h + 1)
    float8_experts = quantization in ("fp8-dynamic", *ROW_BLOCK_8BIT, *PER_CHANNEL_8BIT)
    sparse_layers = sum(cfg.is_sparse_layer(i) for i in layers)
    scale_bytes = sparse_layers * expert_scale_count(cfg, quantization) * 4
    if float8_experts:
        expert_bytes = experts * _FP8_BYTES + scale_bytes
    elif quantization.startswith("int4-"):  # two codes a byte (kiln.layers.moe_int4)
        expert_bytes = experts // 2 + scale_bytes
    else:
        expert_bytes = experts * dtype.itemsize
    linear = sum(i * o for i, o in projections)
    out_channels = sum(o for _, o in projections)
    bias = (q + 2 * kv) * cfg.num_hidden_layers if cfg.attention_bias else 0
    if cfg.kv_lora_rank:  # q_a_proj's (none without it) and kv_a_proj_with_mqa's, o_proj's
        a_out = (cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim
        bias = (a_out + h) * cfg.num_hidden_layers if cfg.attention_bias else 0
    bias += h * cfg.num_hidden_layers if cfg.o_proj_bias else 0
    sinks += cfg.num_attention_heads * cfg.num_hidden_layers if cfg.attention_sinks else 0
    norms = (2 * cfg.num_hidden_layers + 1) * h
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    other = (bias + norms + embeddings + routers + mla) * dtype.itemsize + expert_bytes + sinks * 4
    if quantization == "none":
        return linear * dtype.itemsize + other
    return linear * _FP8_BYTES + out_channels * 4 + other


def activation_bytes(cfg: ModelConfig, dtype: torch.dtype, config: EngineConfig) -> int:
    """An estimate of the largest step's transient memory: per batched token its residual,
    normed input, q/k/v, attention output and the MLP's gate-up and activated halves in `dtype`
    (layers run one at a time, so one layer's worth), plus fp32 logits and two sampler
    temporaries of the vocabulary per sequence slot."""
    tokens = config.max_num_batched_tokens
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size or 0)
    per_token = (3 * cfg.hidden_size + 2 * q + 2 * kv + 3 * inter) * dtype.itemsize
    rows = min(config.max_num_seqs, tokens)
    return tokens * per_token + 3 * rows * cfg.vocab_size * 4


@dataclass(frozen=True)
class ConfigPlan:
    weight_bytes: int
    activation_bytes: int  # 0 on the CPU, where the budget is a fixed size
    kv_bytes_per_token: int
    kv_budget_bytes: int
    block_size: int
    max_model_len: int
    kv_dtype: str
    target: str  # "cpu" or "<GiB> GiB GPU"
    # The KV cache groups (kiln.models.kv_groups) and the most tokens a sequence holds in each
    # (a window's group: its window and a step); empty: one group holding whole contexts.
    groups: tuple[GroupPlan, ...] = ()
    # A pool block's bytes: every layer's K and V of block_size tokens, or a hybrid model's
    # share (its groups' layers share KV tensors); 0: kv_bytes_per_token x block_size.
    kv_bytes_per_block: int = 0

    @property
    def kv_blocks(self) -> int:
        per_block = self.kv_bytes_per_block or self.kv_bytes_per_token * self.block_size
        return self.kv_budget_bytes // per_block

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def sequences_of(self, length: int) -> int:
        """Sequences of `length` tokens the cache holds at once (whole blocks each; a windowed
        group's blocks only those its window and a step keep)."""
        room = self.kv_blocks - step_blocks(self.groups, self.block_size)
        return max(room, 0) // seq_blocks(self.groups, self.block_size, length)

    def sequences_keeping_every_layer(self, length: int) -> int:
        """Sequences of `length` tokens the budget would hold if every layer kept its whole
        context (what a hybrid model's windowed groups save against)."""
        every_layer = self.kv_budget_bytes // (self.kv_bytes_per_token * self.block_size)
        return every_layer // -(-length // self.block_size)

    def lengths(self) -> list[int]:
        return report_lengths(self.max_model_len)

    def describe(self) -> str:
        fits = fits_text(
            self.lengths(),
            self.sequences_of,
            self.sequences_keeping_every_layer,
            [g.window for g in self.groups],
        )
        activations = (
            f", activations ~{self.activation_bytes / GiB:.2f} GiB" if self.activation_bytes else ""
        )
        return (
            f"before loading ({self.target}): weights {self.weight_bytes / GiB:.2f} GiB"
            f"{activations}; KV cache ({self.kv_dtype}, {self.kv_bytes_per_token / 1024:.0f} "
            f"KiB/token) {self.kv_budget_bytes / GiB:.2f} GiB = {self.kv_tokens} tokens: {fits}"
        )


def plan_from_config(
    cfg: ModelConfig,
    config: EngineConfig | None,
    max_model_len: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device_bytes: int | None,
    quantization: str | None = None,
) -> ConfigPlan:
    """`device_bytes`: the GPU's memory (None: the CPU's fixed KV budget). A GPU's KV budget is
    gpu_memory_utilization of it less the weights, the activation estimate and a fixed reserve
    (or kv_cache_memory_gb when set); the profiled plan after loading replaces it. `config`
    None: the engine's defaults (`kiln build`'s plan); `quantization`: the weights' scheme
    when not config's (`kiln build --quantization`)."""
    config = EngineConfig() if config is None else config
    weights = weight_bytes(cfg, dtype, quantization or config.quantization)
    activations = 0
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * GiB)
    elif device_bytes is None:
        budget = int(_CPU_DEFAULT_KV_GB * GiB)
    else:
        activations = activation_bytes(cfg, dtype, config)
        usable = int(device_bytes * config.gpu_memory_utilization)
        budget = max(0, usable - weights - activations - _FIXED_RESERVE)
    target = "cpu" if device_bytes is None else f"{device_bytes / GiB:.0f} GiB GPU"
    layout = cfg.kv_cache_layout
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    return ConfigPlan(
        weights,
        activations,
        per_token,
        budget,
        config.block_size,
        max_model_len,
        str(kv_dtype).removeprefix("torch."),
        target,
        group_plans(cfg, config, max_model_len),
        per_token * layout.num_slots // cfg.num_hidden_layers * config.block_size,
    )
