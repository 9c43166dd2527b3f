"""Random PEFT adapters of a model's shapes, for measuring LoRA's cost on dummy weights: rank R
on all seven projections of every layer, written as PEFT's save_pretrained writes them."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from kiln.lora.peft import CONFIG_FILE, PROJECTIONS, WEIGHTS_FILE
from kiln.lora.request import LoRARequest
from kiln.models.config import ModelConfig


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection PEFT names."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def write_dummy_adapter(cfg: ModelConfig, rank: int, path: str, seed: int) -> None:
    """One adapter whose products are small beside the base layer's (B at 1e-2 scale), so the
    model's activations stay where dummy weights put them."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for name, (fan_in, fan_out) in _shapes(cfg).items():
            block = "self_attn" if name in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=gen) * 1e-2
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
    }
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f)


def dummy_adapters(cfg: ModelConfig, count: int, rank: int, root: str) -> list[LoRARequest]:
    """`count` adapters under `root`, ids 1..count."""
    requests = []
    for n in range(1, count + 1):
        path = os.path.join(root, f"dummy-lora-{n}")
        write_dummy_adapter(cfg, rank, path, seed=n)
        requests.append(LoRARequest(f"dummy-lora-{n}", n, path))
    return requests
