"""Tiny random base models and PEFT adapters made here (no downloads), and HF + PEFT's greedy
tokens as the oracle the LoRA tests compare kiln with."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from tests.conftest import build_tiny_hf_model

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    targets: list[str]
    rslora: bool = False


# Different ranks; one rsLoRA; one on attention only; one on all seven projections.
SPECS = (
    AdapterSpec("all7", 8, 16, ALL_SEVEN),
    AdapterSpec("attn-rs", 4, 8, ATTENTION, rslora=True),
    AdapterSpec("qv-mlp", 2, 6, ["q_proj", "v_proj", "down_proj", "up_proj"]),
)


def build_base(variant: str, path: str):
    """A tiny HF model of `variant` (tests.conftest's) saved at `path`; returns it (fp32)."""
    return build_tiny_hf_model(variant, path)


def build_adapter(base, spec: AdapterSpec, path: str, seed: int):
    """A PEFT LoRA of `spec` on a copy of `base`, random non-zero A and B, saved at `path`;
    returns the PEFT model (the oracle)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=spec.targets,
        use_rslora=spec.rslora,
        init_lora_weights=False,  # B random too: the adapter changes the outputs
    )
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # PEFT's random init is small; larger deltas make sure tokens move
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.eval()
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
