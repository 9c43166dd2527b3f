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


def hf_generated(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF generate's greedy continuation of each prompt, alone, EOS not stopping it."""
    model.generation_config.eos_token_id = None
    want = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            want.append(out[0, len(prompt) :].tolist())
    return want


def triton_chunked_llm(path: str, **kw: Any) -> LLM:
    """The Triton backend (interpreted without a GPU), eager, blocks of 4 and 12-token steps,
    so prompts go in chunks beside decodes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return LLM(
        path, block_size=4, max_num_batched_tokens=12, max_num_seqs=4, kv_cache_memory_gb=0.01,
        device=device, attention_backend="triton", enforce_eager=True, **kw,
    )  # fmt: skip


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


def check_preempted(
    path: str, want: dict, prompts: list[list[int]] = PROMPTS, kv_groups: int = 1
) -> None:
    """8 blocks of 16 tokens in each of `kv_groups` KV cache groups (a hybrid model's pool is
    shared by its groups): the longest request (83 tokens) fits alone, the four at once (16
    blocks a group) do not, so some are preempted and recomputed."""
    llm = LLM(path, num_kv_blocks=8 * kv_groups, block_size=16, enable_prefix_caching=False,
              max_num_batched_tokens=64, device="cpu")  # fmt: skip
    assert tokens(llm.generate(prompts, GREEDY)) == [want[tuple(p)] for p in prompts]
    assert llm.engine.scheduler.num_preemptions_total > 0


def check_gpu(path: str, want: dict, cpu: LLM, prompts: list[list[int]] = PROMPTS) -> None:
    """On a GPU: the Triton path with decode in CUDA graphs, fp32, gives HF's tokens; FP8 W8A8
    with a float8 KV cache stays within float8's noise of the CPU's fp32 model."""
    gpu = LLM(path, device="cuda", dtype="float32", max_num_seqs=16, block_size=16)
    assert gpu.engine.executor.runner.graphs is not None
    assert tokens(gpu.generate(prompts, GREEDY)) == [want[tuple(p)] for p in prompts]
    fp8 = LLM(path, device="cuda", dtype="float32", quantization="fp8-dynamic",
              kv_cache_dtype="fp8", max_num_seqs=16, block_size=16)  # fmt: skip
    gaps = generated_logprob_gaps(fp8.generate(prompts, GREEDY), cpu.generate(prompts, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def check_fp8_close(path: str, llm: LLM, **kw: Any) -> None:
    """FP8 W8A8 with per-token scales (quantization="fp8-dynamic" at load) within the bound
    the Llama float8 paths are held to."""
    fp8 = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **{**ARGS, **kw})
    layer = fp8.engine.executor.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def write_gguf(
    path: str,
    source: str,
    arch: Any,  # gguf.MODEL_ARCH
    name: str,
    adapt: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
    extra: Callable[[Any], None] | None = None,
) -> None:
    """The checkpoint at `source` as llama.cpp's converter writes `name`: its tensor names
    (gguf's own HF -> GGUF name map), F32, the byte-level tokenizer as "gpt2" metadata.
    `adapt(hf_name, tensor)`: the converter's change to a tensor (None: it leaves it out);
    `extra(writer)`: the family's own metadata and tensors (a gguf.GGUFWriter)."""
    import json
    from pathlib import Path

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((Path(source) / "config.json").read_text())
    weights = load_file(str(Path(source) / "model.safetensors"))
    tokenizer = json.loads((Path(source) / "tokenizer.json").read_text())
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])  # Gemma 3: global
    if "rms_norm_eps" in config:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    specials = {t["id"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if i in specials else 1 for _, i in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in
                             tokenizer["model"]["merges"]])  # fmt: skip
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for hf_name, tensor in weights.items():
        out = tensor if adapt is None else adapt(hf_name, tensor)
        if out is not None:
            writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")),
                              out.numpy().astype(np.float32))  # fmt: skip
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
