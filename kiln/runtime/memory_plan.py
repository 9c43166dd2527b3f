"""How many KV blocks fit: from a memory budget on the CPU, from free GPU memory on CUDA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.config import EngineConfig
from kiln.models.llama import LlamaForCausalLM

GiB = 1 << 30
_CPU_DEFAULT_KV_GB = 2.0


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int
    bytes_per_block: int
    kv_budget_bytes: int
    num_blocks: int
    block_size: int

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self, context_len: int) -> str:
        max_seqs = self.kv_tokens // max(context_len, 1)
        return (
            f"weights {self.weight_bytes / GiB:.2f} GiB, KV cache {self.num_blocks} blocks x "
            f"{self.block_size} = {self.kv_tokens} tokens "
            f"({self.num_blocks * self.bytes_per_block / GiB:.2f} GiB): "
            f"{max_seqs} sequences of {context_len} tokens at once"
        )


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int) -> int:
    cfg = model.config
    elem = model.norm.element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


def plan_kv_blocks(
    config: EngineConfig, model: LlamaForCausalLM, max_model_len: int, device: torch.device
) -> MemoryPlan:
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_block = kv_bytes_per_block(model, config.block_size)
    if config.kv_cache_memory_gb is not None:
        budget = int(config.kv_cache_memory_gb * GiB)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_by_others = total - free  # weights already loaded count here
        # Leave room for activations: a generous fixed reserve until the profiled plan lands.
        reserve = 4 * GiB
        budget = int(total * config.gpu_memory_utilization) - used_by_others - reserve
    else:
        budget = int(_CPU_DEFAULT_KV_GB * GiB)
    num_blocks = budget // per_block
    # Never more than every sequence slot at full length could use.
    blocks_per_seq = -(-max_model_len // config.block_size)
    num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq)
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    if num_blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache (budget {budget / GiB:.2f} GiB after weights "
            f"{weight_bytes / GiB:.2f} GiB): lower the model size or raise the budget"
        )
    return MemoryPlan(weight_bytes, per_block, budget, num_blocks, config.block_size)
