"""PEFT LoRA adapters of tiny random HF models, made with `peft` (no downloads): random A and B
(init_lora_weights=False), so an adapter changes what the model says."""

from __future__ import annotations

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def save_adapter(
    base_path: str,
    out: str,
    target_modules: list[str],
    rank: int = 8,
    alpha: float = 16,
    seed: int = 0,
    use_rslora: bool = False,
    scale: float = 1.0,
):
    """Write a LoRA adapter of the HF model at `base_path` to `out`; return the PEFT model (the
    base with the adapter on, fp32). `scale` multiplies lora_B: large enough that greedy tokens
    change on a tiny model."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, torch_dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        init_lora_weights=False,
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    model.save_pretrained(out)
    model.eval()
    return model


def hf_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation by an HF (or PEFT) model, EOS included as any token
    (kiln's ignore_eos; HF's generate would forbid EOS under min_new_tokens instead)."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            tokens = list(ids)
            for _ in range(max_tokens):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
            outs.append(tokens[len(ids) :])
    return outs
