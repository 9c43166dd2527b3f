"""Hugging Face transformers is the oracle: greedy tokens identical, logprobs close."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.conftest import TINY_VARIANTS, build_tiny_hf_model

PROMPTS = [
    [1, 5, 9, 30, 77, 3],
    [1, 200, 13],
    [1, *range(40, 90)],  # longer than one KV block
    [1, 7],
    [1, 99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87, 86, 85, 84],
]
NEW_TOKENS = 24


def assert_greedy_matches_hf(
    hf_model, prompt: list[int], completion, tol: float, label: str
) -> torch.Tensor:
    """kiln's greedy tokens equal HF's, and the logprobs of those tokens are within `tol`.
    Returns HF's logprobs [new tokens, vocab] for further checks."""
    hf_tokens, hf_logprobs = hf_greedy(hf_model, prompt)
    assert completion.token_ids == hf_tokens, f"{label}: prompt {prompt[:5]}..."
    ours = torch.tensor([completion.logprobs[i][t].logprob for i, t in enumerate(hf_tokens)])
    theirs = hf_logprobs[torch.arange(len(hf_tokens)), torch.tensor(hf_tokens)]
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)
    return hf_logprobs


def hf_greedy(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop early
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)  # [new, vocab]
    return tokens, logprobs


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_model_matches_hf(variant, tmp_path):
    hf_model = build_tiny_hf_model(variant, str(tmp_path))
    llm = LLM(str(tmp_path), block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        completion = out.outputs[0]
        hf_logprobs = assert_greedy_matches_hf(hf_model, prompt, completion, 1e-4, variant)
        # The top alternatives are HF's top tokens too.
        top_hf = hf_logprobs[0].topk(3).indices.tolist()
        assert set(completion.logprobs[0]) >= set(top_hf[:1])


def test_prompt_logprobs_match_hf(tmp_path):
    hf_model = build_tiny_hf_model("llama-gqa", str(tmp_path))
    llm = LLM(str(tmp_path), max_num_batched_tokens=16)  # chunked: prompt logprobs span steps
    prompt = PROMPTS[2]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert prompt[pos] in entry
        expected = logits[pos - 1, prompt[pos]].item()
        assert entry[prompt[pos]].logprob == pytest.approx(expected, abs=1e-4)


def test_generation_config_defaults_and_eos_ids(tmp_path):
    import json

    build_tiny_hf_model("llama-gqa", str(tmp_path))
    greedy = LLM(str(tmp_path)).generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=8))
    first_token = greedy[0].outputs[0].token_ids[0]
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, first_token], "temperature": 0.0, "max_new_tokens": 5})
    )
    llm = LLM(str(tmp_path))
    assert first_token in llm.engine.eos_token_ids
    out = llm.generate([PROMPTS[0]])[0].outputs[0]  # no params: the file's defaults apply
    assert out.token_ids == [first_token] and out.finish_reason == "stop"
    out = llm.generate([PROMPTS[1]])[0].outputs[0]
    assert len(out.token_ids) <= 5


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = build_tiny_hf_model("llama-gqa", str(tmp_path / "one"))
    hf_model.save_pretrained(str(tmp_path / "many"), max_shard_size="50KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(str(tmp_path / "one")).generate(PROMPTS, params)
    many = LLM(str(tmp_path / "many")).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in many]


def test_dummy_weights_from_preset():
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=256)
    weight = llm.engine.executor.runner.model.layers[0].mlp.down_proj.weight
    assert 0.015 < weight.std().item() < 0.025  # a trained model's scale, not zeros or garbage
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""  # no tokenizer
