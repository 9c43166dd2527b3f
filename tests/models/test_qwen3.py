"""Qwen3 (dense) on the model plug-in, against Hugging Face in fp32 (eager attention) as the
oracle: greedy tokens equal over 32 new tokens on several prompts alone, batched, chunked and
prefix-cached; a float8 KV cache within float8's noise; a `kiln build --quantization fp8`
engine; a GGUF file named as llama.cpp's converter names Qwen3's tensors; tied embeddings;
each tensor rank's cut."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kiln import LLM, SamplingParams
from tests.conftest import TINY_BASE, generated_logprob_gaps
from tests.models.test_models_vs_hf import hf_greedy

NEW_TOKENS = 32
PROMPTS = [
    [1, 5, 9, 30, 77, 3],
    [1, 200, 13],
    [1, *range(40, 90)],  # longer than one KV block
    [1, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87, 86, 85, 84],
]
# Two prompts sharing two full blocks (32 tokens): the second's prefix comes from the cache.
SHARED = list(range(100, 132))
PREFIXED = [[1, *SHARED, 7, 8], [1, *SHARED, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
ARGS = dict(block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=8, device="cpu")


def save_tiny_qwen3(path: str, seed: int = 0, **overrides: object):
    """A tiny random Qwen3 (head_dim 32 != hidden / heads; q/k norm weights away from 1) with
    the tiny byte-level tokenizer, saved to `path`; returns the HF model, eager attention."""
    import transformers

    from tests.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    cfg = {**TINY_BASE, "vocab_size": len(tokenizer), "head_dim": 32, **overrides}
    config = transformers.AutoConfig.for_model("qwen3", architectures=["Qwen3ForCausalLM"], **cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[str, object]:
    path = str(tmp_path_factory.mktemp("qwen3") / "src")
    return path, save_tiny_qwen3(path)


@pytest.fixture(scope="module")
def hf_tokens(qwen3) -> dict[tuple[int, ...], list[int]]:
    """HF's greedy continuation of every prompt these tests use."""
    _, model = qwen3
    return {tuple(p): hf_greedy_tokens(model, p) for p in [*PROMPTS, *PREFIXED]}


def hf_greedy_tokens(model, prompt: list[int]) -> list[int]:
    import tests.models.test_models_vs_hf as vs_hf

    saved, vs_hf.NEW_TOKENS = vs_hf.NEW_TOKENS, NEW_TOKENS
    try:
        return hf_greedy(model, prompt)[0]
    finally:
        vs_hf.NEW_TOKENS = saved


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    return LLM(qwen3[0], max_num_batched_tokens=64, **ARGS)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_and_alone_equal_hf(llm, hf_tokens) -> None:
    want = [hf_tokens[tuple(p)] for p in PROMPTS]
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == want
    assert [_tokens(llm.generate(p, GREEDY))[0] for p in PROMPTS[:2]] == want[:2]


def test_chunked_prefill_equals_hf(qwen3, hf_tokens) -> None:
    chunked = LLM(qwen3[0], max_num_batched_tokens=16, **ARGS)  # the 51-token prompt: 4 chunks
    assert _tokens(chunked.generate(PROMPTS, GREEDY)) == [hf_tokens[tuple(p)] for p in PROMPTS]


def test_a_prefix_hit_equals_hf(llm, hf_tokens) -> None:
    first = llm.generate(PREFIXED[0], GREEDY)
    hits = llm.engine.kv_cache.stats.hits
    second = llm.generate(PREFIXED[1], GREEDY)
    assert llm.engine.kv_cache.stats.hits > hits
    assert _tokens(first + second) == [hf_tokens[tuple(p)] for p in PREFIXED]


def test_a_float8_kv_cache_stays_within_its_noise(qwen3, llm) -> None:
    """The bound the Llama float8 cache is held to (tests/runtime/test_kv_cache_fp8.py)."""
    fp8 = LLM(qwen3[0], kv_cache_dtype="fp8", max_num_batched_tokens=64, **ARGS)
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps
    assert len(gaps) >= 3 * len(PROMPTS)


def test_tied_embeddings_equal_hf(tmp_path) -> None:
    path = str(tmp_path / "tied")
    model = save_tiny_qwen3(path, seed=1, tie_word_embeddings=True)
    tied = LLM(path, max_num_batched_tokens=64, **ARGS)
    assert tied.engine.executor.runner.model.lm_head is None  # the embedding is the head
    want = [hf_greedy_tokens(model, p) for p in PROMPTS[:2]]
    assert _tokens(tied.generate(PROMPTS[:2], GREEDY)) == want


def test_an_fp8_build_loads_and_stays_close(qwen3, llm, tmp_path) -> None:
    """`kiln build --quantization fp8 --kv-cache-dtype fp8`: static input scales and the float8
    cache's per-layer scales calibrated on text (the keys as the block writes them, after its
    k-norm), float8 weights; the q/k norms stay in the model dtype, the key scales folded into
    k_norm. The engine's tokens stay within float8's noise of the fp32 model (the bound the
    Llama float8 cache is held to)."""
    from kiln.builder.build import BuildOptions, build_engine

    out = str(tmp_path / "fp8")
    options = BuildOptions(
        quantization="fp8",
        kv_cache_dtype="fp8",
        accuracy_check=False,
        max_model_len=256,
        dtype="float32",
    )
    manifest = build_engine(qwen3[0], out, options, None)
    assert manifest.quantization == "fp8" and len(manifest.input_scales) == 4 * 2
    assert len(manifest.kv_scales) == 2 and manifest.kv_scales_in_weights
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    model = engine.engine.executor.runner.model
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.qkv_proj.input_scale is not None and attn.k_norm.dtype == torch.float32
    gaps = generated_logprob_gaps(engine.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def _write_qwen3_gguf(path: Path, source: str) -> None:
    """The checkpoint at `source` as llama.cpp's converter writes arch "qwen3": its tensor names
    (gguf's own HF -> GGUF name map), q/k rows in Hugging Face's order, F32, with the byte-level
    tokenizer as "gpt2" metadata."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((Path(source) / "config.json").read_text())
    weights = load_file(str(Path(source) / "model.safetensors"))
    tokenizer = json.loads((Path(source) / "tokenizer.json").read_text())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
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
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")),
                          tensor.numpy().astype(np.float32))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_equals_hf(qwen3, hf_tokens, tmp_path) -> None:
    from kiln.checkpoint.gguf_loader import GGUFModel

    path = tmp_path / "qwen3.gguf"
    _write_qwen3_gguf(path, qwen3[0])
    names = GGUFModel(str(path)).tensor_types
    assert "blk.0.attn_q_norm.weight" in names and "blk.1.attn_k_norm.weight" in names
    from_gguf = LLM(str(path), max_num_batched_tokens=64, **ARGS)
    assert from_gguf.engine.executor.runner.model.config.architecture == "qwen3"
    assert _tokens(from_gguf.generate(PROMPTS, GREEDY)) == [hf_tokens[tuple(p)] for p in PROMPTS]


def test_each_tensor_rank_holds_its_cut_and_the_whole_qk_norms(qwen3) -> None:
    """At TP=2 each rank's q/k/v rows are its heads' and the per-head norms are whole (every
    rank's heads share them); the layers of a pipeline stage are its own."""
    from kiln.config import EngineConfig
    from kiln.distributed.parallel_state import ParallelContext, RankLayout
    from kiln.runtime.model_loader import load_model

    cpu, fp32 = torch.device("cpu"), torch.float32
    whole = load_model(EngineConfig(model=qwen3[0]), cpu, fp32).model
    want = dict(whole.named_parameters())
    for rank in range(2):
        ctx = ParallelContext(RankLayout(2, 1, rank), None, None, None)
        part = load_model(EngineConfig(model=qwen3[0], tensor_parallel_size=2), cpu, fp32, ctx)
        got = dict(part.model.named_parameters())
        assert torch.equal(got["layers.1.self_attn.k_norm"], want["layers.1.self_attn.k_norm"])
        q_rows = part.model.layers[0].self_attn.q_size
        qkv, full = (
            got["layers.0.self_attn.qkv_proj.weight"],
            want["layers.0.self_attn.qkv_proj.weight"],
        )
        assert torch.equal(qkv[:q_rows], full[rank * q_rows : (rank + 1) * q_rows])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_greedy_equals_hf_on_gpu_with_graphs(qwen3, hf_tokens) -> None:
    """The Triton path (the q/k-norm kernel after the small-batch or GEMM projection), decode
    in CUDA graphs, fp32: tokens identical to HF's."""
    gpu = LLM(qwen3[0], device="cuda", dtype="float32", max_num_seqs=16, block_size=16)
    assert gpu.engine.executor.runner.graphs is not None
    assert _tokens(gpu.generate(PROMPTS, GREEDY)) == [hf_tokens[tuple(p)] for p in PROMPTS]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fp8_weights_and_cache_on_gpu_stay_within_their_noise(qwen3, llm) -> None:
    """FP8 W8A8 (the fused small-batch kernels take the float8 operands, then the q/k-norm
    kernel) with a float8 cache on the GPU, against the CPU's fp32 model."""
    gpu = LLM(qwen3[0], device="cuda", dtype="float32", quantization="fp8-dynamic",
              kv_cache_dtype="fp8", max_num_seqs=16, block_size=16)  # fmt: skip
    gaps = generated_logprob_gaps(gpu.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps
