"""Sliding-window models equal to Hugging Face in fp32 with prompts longer than the window:
Mistral (a window on every layer: the KV manager frees the blocks behind it) and Qwen2 with
max_window_layers (full and windowed layers in one model), alone, batched, chunked, preempted
and prefix-cached."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.conftest import TINY_BASE
from tests.models.family_checks import hf_generated

NEW_TOKENS = 32
PROMPTS = [
    [1, *range(40, 90)],  # 51 tokens: seven windows
    [1, 5, 9, 30, 77, 3],  # shorter than the window (it is passed while decoding)
    [1, *range(200, 223)],
    [1, *range(40, 70), 11, 12],  # shares 31 tokens with the first
]
VARIANTS = {
    # Every layer windowed, a window that is no multiple of the block size.
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=7),
    # Layer 0 full, layers 1 and 2 windowed.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    ),
}
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model(request, tmp_path_factory):
    """(checkpoint path, HF's greedy tokens per prompt, variant)."""
    import transformers

    variant = request.param
    path = str(tmp_path_factory.mktemp(variant))
    cfg = {**TINY_BASE, **VARIANTS[variant]}
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    hf.save_pretrained(path)
    return path, hf_generated(hf, PROMPTS, NEW_TOKENS), variant


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_window_layers_read_from_the_config(model) -> None:
    path, _, variant = model
    llm = LLM(path, block_size=4)
    windows = [
        layer.self_attn.kind.sliding_window for layer in llm.engine.executor.runner.model.layers
    ]
    assert windows == ([7, 7] if variant == "mistral" else [None, 6, 6])
    # Only a model windowed everywhere has its blocks freed behind the window.
    assert llm.engine.kv_cache.sliding_window == (7 if variant == "mistral" else None)
    assert llm.engine.max_model_len == 512  # not capped at the window


def test_alone_and_batched_chunked(model) -> None:
    path, expected, _ = model
    llm = LLM(path, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert [_tokens(llm.generate([p], PARAMS))[0] for p in PROMPTS] == expected
    # Chunks of 5 tokens (shorter than the window, crossing blocks anywhere) beside decodes.
    llm = LLM(path, block_size=4, max_num_batched_tokens=5, enable_prefix_caching=False)
    assert _tokens(llm.generate(PROMPTS, PARAMS)) == expected


def test_preempted(model) -> None:
    path, expected, variant = model
    # Mistral: 8 blocks of 4 hold a window and a step (the blocks behind it are freed) but not
    # four requests; Qwen2 keeps whole contexts in its full layer's group (21 blocks for the
    # longest) and a window and a step in each windowed layer's (6): 36 blocks, one fits.
    num_kv_blocks = 8 if variant == "mistral" else 36
    llm = LLM(
        path, block_size=4, max_num_batched_tokens=8, num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=False,
    )  # fmt: skip
    assert _tokens(llm.generate(PROMPTS, PARAMS)) == expected
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_prefix_cached(model) -> None:
    path, expected, _ = model
    llm = LLM(path, block_size=4, max_num_batched_tokens=16)
    assert _tokens(llm.generate(PROMPTS, PARAMS)) == expected
    again = llm.generate(PROMPTS, PARAMS)  # prompts' blocks now cached (some given back)
    assert _tokens(again) == expected
    assert any(o.num_cached_tokens > 0 for o in again)


# A model windowed on every layer: its every block is given back behind the window.
@pytest.mark.parametrize("model", ["mistral"], indirect=True)
def test_next_turn_hits_the_window_of_an_evicted_conversation(model) -> None:
    path, expected, _ = model
    import transformers

    # 8 blocks of 4: the first turn's early blocks are given back and reused on the way.
    llm = LLM(path, block_size=4, max_num_batched_tokens=8, num_kv_blocks=8)
    assert _tokens(llm.generate(PROMPTS[:1], PARAMS)) == expected[:1]
    turn = [*PROMPTS[0], *expected[0], 5, 6, 7]
    out = llm.generate([turn], PARAMS)[0]
    assert out.num_cached_tokens > len(PROMPTS[0])  # the window before the new tokens, cached
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(
            torch.tensor([turn]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )[0, len(turn) :].tolist()
    assert out.outputs[0].token_ids == want


def test_engine_directory_keeps_the_windows(model, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    path, expected, _ = model
    out = str(tmp_path / "engine")
    build_engine(
        path, out, BuildOptions(dtype="float32", quantization="none", accuracy_check=False), None
    )
    built, source = LLM(out, block_size=4), LLM(path, block_size=4)
    assert built.engine.model_config == source.engine.model_config
    assert _tokens(built.generate(PROMPTS, PARAMS)) == expected


def test_beam_search_forks_past_the_window(model) -> None:
    """Beams fork the prompt's KV copy-on-write after the window has freed its start (Mistral;
    Qwen2's full layer keeps it): the same beams and scores as HF's beam search."""
    import transformers

    from tests.engine.test_beam_search import hf_beams, kiln_beams

    path, _, _ = model
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, block_size=4, dtype="float32")
    want, want_scores = hf_beams(hf, PROMPTS[0], 4, 2, 12, 1.0, False)
    got = kiln_beams(llm, PROMPTS[0], 4, 2, 12, 1.0, False)
    assert [c.token_ids for c in got.outputs] == want
    scores = [c.cumulative_logprob / len(c.token_ids) for c in got.outputs]
    assert scores == pytest.approx(want_scores, abs=1e-4)
    assert llm.engine.kv_cache.pool.num_free_blocks == llm.engine.kv_cache.pool.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_graphs_and_fp8(model) -> None:
    """Triton kernels with decode in CUDA graphs (the window inside them) equal to HF in fp32;
    FP8 W8A8 with a float8 KV cache within float8's noise."""
    from tests.models.family_checks import check_gpu

    path, expected, _ = model
    want = {tuple(p): tokens for p, tokens in zip(PROMPTS, expected, strict=True)}
    check_gpu(path, want, LLM(path, block_size=16), PROMPTS)
