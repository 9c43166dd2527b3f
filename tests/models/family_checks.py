"""What every family's test file checks against Hugging Face (fp32, eager attention) on a tiny
random checkpoint made with transformers: greedy tokens equal over 32 new tokens on several
prompts batched, alone, chunked and prefix-cached; FP8 weights (dynamic scales) within float8's
noise. The family files give a checkpoint; these do the rest."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln import LLM
from tests.conftest import TINY_BASE, generated_logprob_gaps
from tests.models.test_qwen3 import ARGS, GREEDY, PREFIXED, PROMPTS, hf_greedy_tokens


def save_tiny_hf(
    path: str,
    model_type: str,
    architecture: str,
    seed: int = 0,
    perturb: Callable[[torch.nn.Module], None] | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """A tiny random HF model of `model_type` with the tiny byte-level tokenizer, saved to
    `path`; `perturb` moves weights transformers initialises to constants (norms at 1 or 0,
    biases at 0) so the test can see them. Returns the model, eager attention, fp32."""
    import transformers

    from tests.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    cfg = {**TINY_BASE, "vocab_size": len(tokenizer), **overrides}
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture], **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if perturb is not None:
        with torch.no_grad():
            perturb(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def perturb_norms_and_biases(model: torch.nn.Module, std: float = 0.3) -> None:
    """Every 1-D parameter (norm weights, biases) moved off its constant init."""
    gen = torch.Generator().manual_seed(7)
    for name, param in model.named_parameters():
        if param.dim() == 1:
            center = 1.0 if "norm" in name and param.detach().abs().mean() > 0.5 else 0.0
            param.copy_(center + std * torch.randn(param.shape, generator=gen))


def hf_tokens(model: torch.nn.Module, prompts: list[list[int]]) -> dict[tuple[int, ...], list]:
    return {tuple(p): hf_greedy_tokens(model, p) for p in prompts}


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def check_alone_and_batched(llm: LLM, want: dict, prompts: list[list[int]] = PROMPTS) -> None:
    expected = [want[tuple(p)] for p in prompts]
    assert tokens(llm.generate(prompts, GREEDY)) == expected
    assert [tokens(llm.generate(p, GREEDY))[0] for p in prompts[:2]] == expected[:2]


def check_chunked(path: str, want: dict, prompts: list[list[int]] = PROMPTS, **kw: Any) -> None:
    chunked = LLM(path, max_num_batched_tokens=16, **{**ARGS, **kw})  # the 51-token prompt: 4
    assert tokens(chunked.generate(prompts, GREEDY)) == [want[tuple(p)] for p in prompts]


def check_prefix_hit(llm: LLM, want: dict) -> None:
    first = llm.generate(PREFIXED[0], GREEDY)
    hits = llm.engine.kv_cache.stats.hits
    second = llm.generate(PREFIXED[1], GREEDY)
    assert llm.engine.kv_cache.stats.hits > hits
    assert tokens(first + second) == [want[tuple(p)] for p in PREFIXED]


def check_fp8_close(path: str, llm: LLM, **kw: Any) -> None:
    """FP8 W8A8 with per-token scales (quantization="fp8-dynamic" at load) within the bound
    the Llama float8 paths are held to."""
    fp8 = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **{**ARGS, **kw})
    layer = fp8.engine.executor.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps
