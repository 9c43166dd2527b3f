"""The float8 LM head (EngineConfig.lm_head_quantization / `kiln build --lm-head-quantization`):
float8 weights per vocabulary row with dynamic per-token activations, loaded from a checkpoint,
from a tied embedding, from an engine built with or without it; the logits close to the model
dtype head's. Its accuracy cost on the real SmolLM2 (+3.1% word perplexity on WikiText-2, why it
is off by default) is a measurement, not a test."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.errors import BuildError
from kiln.kernels import reference
from tests.conftest import build_tiny_hf_model

FP8 = torch.float8_e4m3fn
PROMPTS = [[1, 5, 9, 33, 70, 12, 200, 4], [1, 100, 3, 3, 51, 8], [1, 250, 17, 90, 42, 7, 130]]


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return torch.tensor(
        [
            entry[token].logprob
            for out in outs
            for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])
        ]
    )


def _model(llm: LLM):
    return llm.engine.executor.runner.model


@pytest.fixture(scope="module", params=["llama-gqa", "llama-tied"])
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    build_tiny_hf_model(request.param, path)
    ref = LLM(path, device="cpu", enable_prefix_caching=False)
    head = LLM(path, device="cpu", enable_prefix_caching=False, lm_head_quantization="fp8")
    return request.param, path, ref, head


def test_float8_head_is_the_quantized_head_and_close(tiny) -> None:
    variant, _, ref, llm = tiny
    model, want_model = _model(llm), _model(ref)
    head = model.lm_head
    assert head.weight.dtype == FP8 and head.weight_scale.shape == (head.out_features,)
    # The source's head (a tied model's: its embedding, which stays in the model dtype for the
    # lookup) quantized per row, as reference.quantize_fp8 does.
    source = (
        want_model.embed_tokens.weight if variant == "llama-tied" else want_model.lm_head.weight
    )
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, want_model.embed_tokens.weight)
    w_fp8, w_scale = reference.quantize_fp8(source.float(), None)
    assert torch.equal(head.weight.view(torch.uint8), w_fp8.view(torch.uint8))
    assert torch.equal(head.weight_scale, w_scale.view(-1))
    # The decoder is untouched, so only the head's float8 noise moves the logprobs: less than the
    # whole W8A8 model's (test_fp8_linear's bounds: mean 0.13, max 0.6).
    gaps = (_prompt_logprobs(llm) - _prompt_logprobs(ref)).abs()
    assert 0 < float(gaps.mean()) < 0.08 and float(gaps.max()) < 0.4, gaps
    with pytest.raises(ValueError, match="needs the kernels"):
        model.compute_logits(torch.zeros(1, head.in_features))


def test_engines_record_the_float8_head_and_load_it(tiny, tmp_path) -> None:
    """Built with the float8 head: the manifest says so and the engine loads with it (the load
    option unset). Built without: loading with the option quantizes the head at load. Both give
    the logprobs of the checkpoint loaded with the option, exactly."""
    _, path, _, llm = tiny
    want = _prompt_logprobs(llm)
    # (The tiny model has no tokenizer for the perplexity check: skipped, but not as unchanged.)
    options = {"accuracy_check": False}
    fp8_head = build_engine(
        path, str(tmp_path / "h8"), BuildOptions(lm_head_quantization="fp8", **options), None
    )
    assert fp8_head.lm_head_quantization == "fp8"
    assert fp8_head.accuracy == {"checked": False, "reason": "--no-accuracy-check"}
    plain = build_engine(path, str(tmp_path / "plain"), BuildOptions(**options), None)
    assert plain.lm_head_quantization == "none" and plain.engine_id != fp8_head.engine_id
    for engine, option in ((tmp_path / "h8", "none"), (tmp_path / "plain", "fp8")):
        got = LLM(str(engine), device="cpu", enable_prefix_caching=False,
                  lm_head_quantization=option)  # fmt: skip
        assert _model(got).lm_head.weight.dtype == FP8
        assert torch.equal(_prompt_logprobs(got), want), engine
        got.shutdown()


def test_an_unknown_head_quantization_is_refused() -> None:
    BuildOptions(
        dtype="float32", lm_head_quantization="fp8", tensor_parallel_size=2
    )  # cut per rank (test_parallel)
    with pytest.raises(BuildError, match="lm_head_quantization must be one of"):
        BuildOptions(dtype="float32", lm_head_quantization="int8")
