"""How many KV blocks fit: from a memory budget on the CPU, from a profiled plan on CUDA.

On CUDA: weights are loaded; a dummy step at the largest shape the scheduler can hand out
(max_num_batched_tokens tokens, max_num_seqs sampling rows, random sampling with top-k/top-p) is
run and its peak measured; whatever `gpu_memory_utilization` of the card is left after weights,
that peak, memory outside PyTorch's allocator (CUDA context, cuBLAS workspaces, other processes)
and a reserve for the decode graphs becomes KV cache. No step the scheduler can form needs more
than the profiled one, so no load the plan admits runs out of memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kiln.attention.backend import AttentionMetadata, get_attention_backend
from kiln.config import EngineConfig
from kiln.kernels.kv_layout import empty_layer_cache
from kiln.kernels.ops import kernel_ops, resolve_kernel_backend
from kiln.models.base import CausalLM
from kiln.models.config import ModelConfig
from kiln.models.packed_prefill import packed_prefill_metadata
from kiln.runtime.fits import fits_record, fits_text, report_lengths
from kiln.sampling.sampler import Sampler, SamplingMetadata

logger = logging.getLogger("kiln")

GiB = 1 << 30
_CPU_DEFAULT_KV_GB = 2.0
# Beyond the profiled peaks: allocator fragmentation, the graph capture stream's cuBLAS workspace,
# Triton's launch-time scratch. Measured slack on an H200 was well under this.
_SAFETY_MARGIN = GiB // 2


class PlannedModel(Protocol):
    """What the plan reads of a model or a speculative draft (a draft model, an EAGLE-3 head):
    the shape its KV cache is sized by, and its weights."""

    @property
    def config(self) -> ModelConfig: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group as the plan counts it (kiln.models.kv_groups)."""

    window: int | None  # its layers' window; None: full attention
    num_layers: int  # this rank's layers in it
    tokens_held: int | None  # the most tokens' KV a sequence holds in it between steps; None: all
    # A windowed group's room for one step's new tokens beyond the sequences' windows (a
    # prompt chunk's blocks are all held while it runs; a step has at most this many tokens).
    step_tokens: int = 0


def step_blocks(groups: tuple[GroupPlan, ...], block_size: int) -> int:
    """Pool blocks set aside for one step's new tokens in the windowed groups."""
    return sum(-(-g.step_tokens // block_size) for g in groups)


def seq_blocks(
    groups: tuple[GroupPlan, ...], block_size: int, context_len: int, alone: bool = False
) -> int:
    """Pool blocks a sequence of context_len tokens holds between steps (MemoryPlan.groups);
    `alone`: at its most, its own step's tokens included (a prompt chunk's blocks are all held
    in a windowed group while it runs)."""
    if not groups:
        return -(-max(context_len, 1) // block_size)
    total = 0
    for g in groups:
        held = context_len if g.tokens_held is None else g.tokens_held + alone * g.step_tokens
        total += -(-max(min(context_len, held), 1) // block_size)
    return total


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int
    bytes_per_block: int
    kv_budget_bytes: int
    num_blocks: int
    block_size: int
    activation_bytes: int = 0  # profiled peak of the largest step, above the weights
    graph_reserve_bytes: int = 0  # set aside for the decode graphs' memory pool
    non_torch_bytes: int = 0  # CUDA context, library workspaces, other processes
    total_bytes: int = 0  # the device's memory (0 on the CPU)
    kv_dtype: str = ""  # the cache's element type, e.g. "bfloat16" or "float8_e4m3fn"
    # Of weight_bytes, the routed experts' (weights and scales): a decode step reads only the
    # experts its tokens pick, so the benchmark's roofline counts these apart.
    expert_weight_bytes: int = 0
    # The KV cache groups, each with the most tokens a sequence holds in it (a window's group:
    # its window and one step; kiln.kv_cache frees the rest). Empty: one group of every layer,
    # holding each sequence's whole context.
    groups: tuple[GroupPlan, ...] = ()
    layer_token_bytes: int = 0  # K and V of one layer for one token (0: not given)

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_tokens_held(self) -> int | None:
        """The most tokens' KV one sequence holds at once with one group (a window on every
        layer); None: its whole context, or several groups (see blocks_per_seq)."""
        return self.groups[0].tokens_held if len(self.groups) == 1 else None

    def blocks_per_seq(self, context_len: int) -> int:
        """Pool blocks one sequence of context_len tokens holds at its longest: a block in each
        group for each of its blocks of tokens (a windowed group: of those it keeps)."""
        return seq_blocks(self.groups, self.block_size, context_len)

    def max_concurrent_seqs(self, context_len: int, num_blocks: int | None = None) -> int:
        """Sequences of context_len tokens that num_blocks (default: the cache's) hold at once."""
        num_blocks = self.num_blocks if num_blocks is None else num_blocks
        room = num_blocks - step_blocks(self.groups, self.block_size)
        return max(room, 0) // self.blocks_per_seq(context_len)

    def longest_fitting(self, max_model_len: int) -> int:
        """The longest context (up to max_model_len) one sequence can hold on its own in the
        cache: every admitted request must, or preemption could never help."""
        groups, bs = self.groups, self.block_size
        if seq_blocks(groups, bs, max_model_len, alone=True) <= self.num_blocks:
            return max_model_len
        low, high = 0, max_model_len  # the blocks grow with the length: bisect
        while low < high:
            mid = (low + high + 1) // 2
            if seq_blocks(groups, bs, mid, alone=True) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def kv_bytes_read(self, context_len: float) -> float:
        """The KV bytes a decode of a context_len-token sequence reads: every layer its
        window's tokens (all of them without one)."""
        if not self.groups or not self.layer_token_bytes:
            return self.bytes_per_block / self.block_size * context_len
        return self.layer_token_bytes * sum(
            g.num_layers * min(context_len, g.window or context_len) for g in self.groups
        )

    def sequences_keeping_every_layer(self, context_len: int) -> int:
        """Sequences of context_len tokens the cache's memory would hold if every layer kept its
        whole context (what windowed layers save against)."""
        blocks = -(-context_len // self.block_size)
        if len(self.groups) > 1 and self.layer_token_bytes:  # a pool block holds some layers
            layers = sum(g.num_layers for g in self.groups)
            seq_bytes = blocks * self.block_size * layers * self.layer_token_bytes
            return self.num_blocks * self.bytes_per_block // seq_bytes
        return self.num_blocks // blocks

    def describe(self, context_len: int) -> str:
        """The plan in a line; sequences that fit at the report lengths up to context_len."""
        fits = fits_text(
            report_lengths(context_len),
            self.max_concurrent_seqs,
            self.sequences_keeping_every_layer,
            [g.window for g in self.groups],
        )
        text = (
            f"weights {self.weight_bytes / GiB:.2f} GiB, KV cache ({self.kv_dtype}) "
            f"{self.num_blocks} blocks x "
            f"{self.block_size} = {self.kv_tokens} tokens "
            f"({self.num_blocks * self.bytes_per_block / GiB:.2f} GiB): {fits}"
        )
        if self.total_bytes:
            text += (
                f"; activations {self.activation_bytes / GiB:.2f} GiB (profiled), graphs "
                f"{self.graph_reserve_bytes / GiB:.2f} GiB, outside torch "
                f"{self.non_torch_bytes / GiB:.2f} GiB, of {self.total_bytes / GiB:.1f} GiB"
            )
            # The cache never outgrows max_num_seqs full-length sequences; say what the budget
            # would hold (at 1000/1000, 960 sequences in flight ran 1.07% faster than 768).
            room = self.max_concurrent_seqs(
                context_len, self.kv_budget_bytes // self.bytes_per_block
            )
            if room > self.max_concurrent_seqs(context_len):
                text += (
                    f"; the budget holds {room} x {context_len} (the cache is capped below it: "
                    "max_num_seqs x max_model_len, or num_kv_blocks)"
                )
        return text

    def as_dict(self, context_len: int | None = None) -> dict:
        """The plan's numbers; with context_len, the sequences that fit at the report lengths
        up to it (planned, and with every layer keeping its whole context)."""
        record = {
            "weight_gib": self.weight_bytes / GiB,
            "expert_weight_gib": self.expert_weight_bytes / GiB,
            "activation_gib": self.activation_bytes / GiB,
            "graph_reserve_gib": self.graph_reserve_bytes / GiB,
            "non_torch_gib": self.non_torch_bytes / GiB,
            "kv_gib": self.num_blocks * self.bytes_per_block / GiB,
            "kv_blocks": self.num_blocks,
            "kv_tokens": self.kv_tokens,
            "kv_dtype": self.kv_dtype,
        }
        if context_len is not None:
            record["sequences_that_fit"] = fits_record(
                report_lengths(context_len),
                self.max_concurrent_seqs,
                self.sequences_keeping_every_layer,
            )
        return record


def routed_expert_bytes(model: PlannedModel) -> int:
    """Bytes of the parameters of the model's routed experts (kiln.layers.moe.FusedMoE's, named
    `...experts.*`; a shared expert is dense), 0 for a dense model."""
    if not isinstance(model, nn.Module):
        return 0
    return sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name
    )


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype) -> int:
    """K and V of every layer for one token (what `kiln build` plans with, before any load); an
    MLA layer's one latent row (ModelConfig.kv_tensors_per_layer)."""
    per_layer = cfg.kv_tensors_per_layer * cfg.num_key_value_heads * cfg.head_dim
    return cfg.num_hidden_layers * per_layer * kv_dtype.itemsize


def kv_bytes_per_block(model: PlannedModel, block_size: int, kv_dtype: torch.dtype) -> int:
    """A pool block: K and V of block_size tokens in each KV tensor this rank makes (a hybrid
    model's layers share tensors: kiln.models.kv_groups)."""
    cfg = model.config
    elem = kv_dtype.itemsize
    per_token = cfg.kv_tensors_per_layer * cfg.num_key_value_heads * cfg.head_dim * elem
    return _num_kv_tensors(model) * block_size * per_token


def _stage_layers(model: PlannedModel) -> range:
    """This rank's layers, as indices in the whole model."""
    start = getattr(model, "layer_start", 0)
    return range(start, start + model.config.num_hidden_layers)


def _num_kv_tensors(model: PlannedModel) -> int:
    full = getattr(model, "full_config", model.config)
    layout = full.kv_cache_layout
    if not layout.is_hybrid:
        return model.config.num_hidden_layers
    placement = layout.placement()
    return len({placement[i][1] for i in _stage_layers(model)})


def max_tokens_held(window: int | None, block_size: int, max_model_len: int) -> int | None:
    """The most tokens' KV one request holds between steps in layers of this window (None: its
    whole context): the window's blocks (kiln.kv_cache frees those behind it), one more where
    it starts mid-block and one for the next token."""
    if window is None:
        return None
    return min(max_model_len, window - 1 + 2 * block_size)


def step_tokens(config: EngineConfig) -> int:
    """The most new tokens one step computes (drafts included)."""
    spec = config.speculative
    return config.max_num_batched_tokens + (spec.num_speculative_tokens if spec else 0)


def group_plans(
    model_config: ModelConfig,
    config: EngineConfig,
    max_model_len: int,
    layers: range | None = None,
) -> tuple[GroupPlan, ...]:
    """Each KV cache group of the model (its layers among `layers`, default all) and the most
    tokens a sequence holds in it."""
    layers = range(model_config.num_hidden_layers) if layers is None else layers
    return tuple(
        GroupPlan(
            g.window,
            sum(1 for i in g.layers if i in layers),
            max_tokens_held(g.window, config.block_size, max_model_len),
            0 if g.window is None else step_tokens(config),
        )
        for g in model_config.kv_cache_layout.groups
    )


def resident_bytes(model: PlannedModel) -> int:
    """A model's parameters, and its weights re-laid into buffers (INT4's codes for the sm_90
    kernel, whose parameter is then left empty)."""
    relaid = [b for name, b in model.named_buffers() if name.endswith(".weight_mma")]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *relaid])


def plan_kv_blocks(
    config: EngineConfig,
    model: CausalLM,
    max_model_len: int,
    device: torch.device,
    kv_dtype: torch.dtype,
    draft_model: PlannedModel | None = None,
) -> MemoryPlan:
    weight_bytes = resident_bytes(model)
    expert_bytes = routed_expert_bytes(model)
    per_block = kv_bytes_per_block(model, config.block_size, kv_dtype)
    cfg = model.config
    layer_token_bytes = (
        cfg.kv_tensors_per_layer * cfg.num_key_value_heads * cfg.head_dim * kv_dtype.itemsize
    )
    groups = group_plans(model.full_config, config, max_model_len, _stage_layers(model))
    if draft_model is not None:
        # Speculative decoding's draft: its weights, and a KV pool of as many blocks as the
        # target's (kiln.spec_decode.draft_model), so every target block costs both.
        weight_bytes += resident_bytes(draft_model)
        per_block += kv_bytes_per_block(draft_model, config.block_size, kv_dtype)
    activation = graph_reserve = non_torch = total = 0
    if device.type == "cuda":
        activation, forward_peak = profile_activation_peak(
            config, model, max_model_len, device, kv_dtype
        )
        graph_reserve = 0
        if not config.enforce_eager:
            # The pool holds one decode forward's intermediates at the largest graph batch size
            # (captures share it) plus each graph's output.
            per_token = forward_peak / max(config.max_num_batched_tokens, 1)
            graph_reserve = int(per_token * config.max_num_seqs) + 256 * (1 << 20)
        free, total = torch.cuda.mem_get_info(device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * GiB)
    elif device.type == "cuda":
        budget = (
            int(total * config.gpu_memory_utilization)
            - non_torch
            - torch.cuda.memory_allocated(device)  # the weights (and buffers) already loaded
            - activation
            - graph_reserve
            - _SAFETY_MARGIN
        )
    else:
        budget = int(_CPU_DEFAULT_KV_GB * GiB)
    num_blocks = budget // per_block
    # Never more than every sequence slot at full length could use (a windowed group holds a
    # sequence's window and one step's tokens: kiln.kv_cache frees the rest).
    most = config.max_num_seqs * seq_blocks(groups, config.block_size, max_model_len)
    num_blocks = min(num_blocks, most + step_blocks(groups, config.block_size))
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache (budget {budget / GiB:.2f} GiB after weights "
            f"{weight_bytes / GiB:.2f} GiB, activations {activation / GiB:.2f} GiB): lower "
            "max_num_batched_tokens or max_num_seqs, or raise gpu_memory_utilization"
        )
    plan = MemoryPlan(
        weight_bytes,
        per_block,
        budget,
        num_blocks,
        config.block_size,
        activation,
        graph_reserve,
        non_torch,
        total,
        str(kv_dtype).removeprefix("torch."),
        expert_bytes,
        groups,
        layer_token_bytes,
    )
    logger.info("memory plan: %s", plan.describe(max_model_len))
    return plan


@torch.inference_mode()
def profile_activation_peak(
    config: EngineConfig,
    model: CausalLM,
    max_model_len: int,
    device: torch.device,
    kv_dtype: torch.dtype,
) -> tuple[int, int]:
    """(peak of a whole step, peak of the forward alone), in bytes above what was allocated
    before: max_num_batched_tokens prompt tokens spread over up to max_num_seqs sequences, every
    one sampling with penalties, temperature, top-k, top-p and logprobs (the sampler's largest
    temporaries)."""
    step = _largest_step(config, model.config, max_model_len, device, kv_dtype)
    kernels = resolve_kernel_backend(config.attention_backend, device)
    ops, backend = kernel_ops(kernels), get_attention_backend(kernels, device)

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = model(ops, backend, step.input_ids, step.positions, step.caches, step.metadata)
    torch.cuda.synchronize(device)
    forward_peak = torch.cuda.max_memory_allocated(device) - base
    logits = model.compute_logits(hidden[step.last_token_indices], ops)
    del hidden
    Sampler()(logits, _heaviest_sampling(step.num_seqs, device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    num_tokens, num_seqs = step.input_ids.shape[0], step.num_seqs
    del logits, step
    torch.cuda.empty_cache()
    logger.info(
        "profiled step of %d tokens / %d sequences: peak %.2f GiB (forward %.2f GiB)",
        num_tokens,
        num_seqs,
        peak / GiB,
        forward_peak / GiB,
    )
    return peak, forward_peak


@dataclass
class _ProfileStep:
    input_ids: torch.Tensor
    positions: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    metadata: AttentionMetadata
    last_token_indices: torch.Tensor
    num_seqs: int


def _largest_step(
    config: EngineConfig,
    cfg: ModelConfig,
    max_model_len: int,
    device: torch.device,
    kv_dtype: torch.dtype,
) -> _ProfileStep:
    """The largest step the scheduler can form, as prompt chunks in a scratch cache just big
    enough for it: no sequence longer than max_model_len (a longer one would index past the
    rotary table and the block table)."""
    num_tokens = min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len)
    num_seqs = max(1, min(config.max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    block_size = config.block_size
    lens = [num_tokens // num_seqs] * num_seqs
    lens[-1] += num_tokens - sum(lens)
    metadata, num_blocks = packed_prefill_metadata(lens, block_size, device)
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [
        empty_layer_cache(shape, kv_dtype, device, tensors=cfg.kv_tensors_per_layer)
        for _ in range(cfg.num_hidden_layers)
    ]
    return _ProfileStep(
        input_ids=torch.randint(0, cfg.vocab_size, (num_tokens,), device=device),
        positions=torch.cat([torch.arange(n) for n in lens]).to(device),
        caches=caches,
        metadata=metadata,
        last_token_indices=metadata.query_start_loc[1:] - 1,
        num_seqs=num_seqs,
    )


def _heaviest_sampling(num_seqs: int, device: torch.device) -> SamplingMetadata:
    """Every row random with penalties, top-k/p, min-p and logprobs: the sampler's largest
    temporaries."""

    def column(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((num_seqs,), value, dtype=dtype, device=device)

    return SamplingMetadata(
        temperature=column(0.8),
        top_k=column(50, torch.int64),
        top_p=column(0.9),
        min_p=column(0.05),
        repetition_penalty=column(1.1),
        presence_penalty=column(0.1),
        frequency_penalty=column(0.1),
        prompt_token_ids=[[1, 2, 3]] * num_seqs,
        output_token_ids=[[4]] * num_seqs,
        generators=[None] * num_seqs,
        min_tokens_mask_ids=[[] for _ in range(num_seqs)],
        max_num_logprobs=5,
        all_greedy=False,
        all_random=True,
        no_penalties=False,
    )
