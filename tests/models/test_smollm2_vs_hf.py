"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers loading the same file."""

from __future__ import annotations

import os

import pytest
import torch

from kiln import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path),
        gguf_file=os.path.basename(smollm2_path),
        torch_dtype=torch.float32,
    )
    return model.eval()


def test_greedy_matches_hf_on_8_prompts(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.get_tokenizer()
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0)
    outputs = smollm2_llm.chat(conversations, params)
    for conv, out in zip(conversations, outputs):
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        prompt_ids = tok.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == prompt_ids
        with torch.no_grad():
            hf = hf_smollm2.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=2,
                pad_token_id=2,
            )
        hf_tokens = hf.sequences[0, len(prompt_ids) :].tolist()
        completion = out.outputs[0]
        assert completion.token_ids == hf_tokens, conv[0]["content"]
        hf_lp = torch.stack(hf.logits, 1)[0].float().log_softmax(-1)
        ours = torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, hf_tokens)])
        theirs = hf_lp[torch.arange(len(hf_tokens)), torch.tensor(hf_tokens)]
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)


def test_capital_of_france(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> from the GGUF's eos id


def test_stream_equals_generate(smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=40)
    pieces = list(smollm2_llm.stream("The three primary colours are", params))
    full = smollm2_llm.generate("The three primary colours are", params)[0].outputs[0].text
    assert "".join(pieces) == full and len(pieces) > 1


def test_beam_search_matches_hf(smollm2_llm, hf_smollm2):
    """Beam search (engine/beam_search.py), width 4, against HF generate(num_beams=4)."""
    tok = smollm2_llm.get_tokenizer()
    conv = [{"role": "user", "content": "Name a fruit."}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        hf = hf_smollm2.generate(
            torch.tensor([prompt_ids]),
            num_beams=4,
            num_return_sequences=2,
            do_sample=False,
            max_new_tokens=8,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=2,
            pad_token_id=2,
        )
    want = []
    for seq in hf.sequences[:, len(prompt_ids) :].tolist():
        want.append(seq[: seq.index(2) + 1] if 2 in seq else seq)
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=8)
    got = smollm2_llm.generate([prompt_ids], params)[0].outputs
    assert [c.token_ids for c in got] == want
    scores = [c.cumulative_logprob / len(c.token_ids) for c in got]
    assert scores == pytest.approx(hf.sequences_scores.tolist(), abs=1e-3)
