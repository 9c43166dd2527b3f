"""`kiln eval`: lm-eval's rolling windows, perplexity metrics and GSM8K scoring; perplexity from
kiln's prompt logprobs against plain transformers forward passes."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch

from kiln.cli.main import main
from kiln.errors import EvalError
from kiln.eval import get_task
from kiln.eval.gsm8k import build_prompts, exact_match, extract, read_jsonl
from kiln.eval.gsm8k import run as run_gsm8k
from kiln.eval.perplexity import (
    perplexity_metrics,
    prefix_token_id,
    rolling_perplexity,
    rolling_token_windows,
    token_loglikelihoods,
)
from kiln.eval.wikitext import load_documents, split_documents, wikitext_detokenizer

DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")


@pytest.fixture(scope="module")
def data_dir() -> str:
    if not os.path.isdir(DATA_DIR):
        pytest.fail(f"the shared eval data is missing: expected {os.path.abspath(DATA_DIR)}")
    return DATA_DIR


def lm_eval_windows(token_list, prefix_token, max_seq_len):
    """lm-eval 0.4.13's `get_rolling_token_windows(..., context_len=1)` then
    `make_disjoint_window`, transcribed (lm-eval itself pulls in datasets, pandas, scipy, ...;
    kiln's version was also checked against the real one on 3,000 random lists)."""
    context_len = 1
    pred_len = max_seq_len - context_len + 1
    predicted = 0
    first_seq_len = min(max_seq_len, len(token_list))
    windows = []
    if token_list:
        first = [prefix_token, *token_list[: first_seq_len - 1]]
        windows.append((first, token_list[:first_seq_len]))
        predicted += first_seq_len
    while predicted < len(token_list):
        window_pred_len = min(len(token_list) - predicted, pred_len)
        window_end = predicted + window_pred_len
        windows.append(
            (
                token_list[window_end - max_seq_len - 1 : window_end - 1],
                token_list[window_end - window_pred_len : window_end],
            )
        )
        predicted += window_pred_len
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in windows]


def test_rolling_windows_equal_lm_evals() -> None:
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(50) for _ in range(rng.randint(0, 40))]
        max_seq_len = rng.randint(1, 12)
        got = list(rolling_token_windows(tokens, 99, max_seq_len))
        assert got == lm_eval_windows(tokens, 99, max_seq_len), (tokens, max_seq_len)
        assert [t for _, cont in got for t in cont] == tokens  # each token predicted once


def test_metrics_on_a_hand_computed_case() -> None:
    # words 3 + 2, bytes 5 + 3, tokens 4 + 6, loglikelihood -10 - 20
    r = perplexity_metrics([-10.0, -20.0], [4, 6], ["a b c", "d e"])
    assert (r.num_words, r.num_tokens, r.num_documents) == (5, 10, 2)
    assert r.word_perplexity == pytest.approx(math.exp(6))
    assert r.byte_perplexity == pytest.approx(math.exp(30 / 8))
    assert r.bits_per_byte == pytest.approx(30 / 8 / math.log(2))
    assert r.token_perplexity == pytest.approx(math.exp(3))


def test_wikitext_documents_as_lm_eval_splits_them(data_dir) -> None:
    text = " \n = A = \n \n x . \n = = Sub = = \n y \n = B = \n z @-@ w \n"
    pages = [" = A = \n \n x . \n = = Sub = = \n y ", " = B = \n z @-@ w \n"]
    assert split_documents(text) == pages
    assert wikitext_detokenizer(" = B = \n z @-@ w , 5 @.@ 2 ( x ) \n") == " = B =\nz-w, 5.2 (x)\n"
    assert len(load_documents(data_dir)) == 62  # lm-eval's wikitext-2 test has 62 documents
    assert len(load_documents(data_dir, "validation")) == 60


def _hf_rolling_loglikelihood(hf_model, tokens, prefix_token, max_length) -> float:
    """The same windows scored with plain transformers forward passes."""
    total = 0.0
    for context, continuation in rolling_token_windows(tokens, prefix_token, max_length - 2):
        ids = torch.tensor([(context + continuation)[:-1]])
        with torch.no_grad():
            logprobs = hf_model(ids).logits[0].float().log_softmax(-1)
        rows = logprobs[len(context) - 1 :]
        total += rows.gather(1, torch.tensor(continuation)[:, None]).sum().item()
    return total


def test_tiny_random_model_matches_transformers(tmp_path) -> None:
    from kiln import LLM
    from tests.conftest import build_tiny_hf_model

    hf = build_tiny_hf_model("llama-gqa", str(tmp_path))
    llm = LLM(str(tmp_path), max_num_seqs=16, kv_cache_memory_gb=0.1, max_model_len=64)
    rng = random.Random(1)
    docs = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 61, 150)]
    prefix = prefix_token_id(llm)
    assert prefix == 1  # the config's BOS: this model has no tokenizer
    got = token_loglikelihoods(llm, docs, prefix)  # max_length: the engine's 64
    want = [_hf_rolling_loglikelihood(hf, d, prefix, 64) for d in docs]
    assert got == pytest.approx(want, rel=1e-4)
    ppl = math.exp(-sum(got) / sum(map(len, docs)))
    assert 1 < ppl < 2 * 256  # a random model: around the vocabulary size


@pytest.fixture(scope="module")
def short_wikitext_dir(tmp_path_factory, data_dir) -> str:
    """A data directory whose WikiText-2 test split holds two short articles of the real one."""
    pages = load_documents(data_dir)
    short = [pages[29], pages[28]]  # 284 and 36 tokens
    root = tmp_path_factory.mktemp("data")
    os.makedirs(root / "wikitext-2")
    (root / "wikitext-2" / "test.txt").write_text("\n".join(short), encoding="utf-8")
    assert load_documents(str(root)) == short
    return str(root)


def test_smollm2_rolling_perplexity(smollm2_llm, short_wikitext_dir) -> None:
    page = load_documents(short_wikitext_dir)[0]
    text = wikitext_detokenizer(page)
    # 160: two windows, so the rolling path runs on a real model. Against transformers' forward
    # passes over the same windows (the GGUF loaded into transformers, fp32) the loglikelihood
    # agreed to 4e-8 relative on this page and on the first (1,434 tokens, 2 windows at
    # max_length 1024); that load takes ~15 s, too long for this suite.
    result = rolling_perplexity(smollm2_llm, [text], max_length=160, counted_texts=[page])
    assert (result.num_tokens, result.num_words, result.num_documents) == (284, 249, 1)
    assert 20 < result.word_perplexity < 150, result  # measured 60.5 (59.1 at full context)
    assert 1 < result.bits_per_byte < 2, result


def test_eval_cli_on_smollm2(smollm2_llm, short_wikitext_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("kiln.llm.LLM", lambda **_: smollm2_llm)  # the shared engine
    out = tmp_path / "scores.json"
    argv = ["eval", "--tasks", "wikitext", "--limit", "1", "--data-dir", short_wikitext_dir]
    assert main([*argv, "--output-json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "|wikitext||word_perplexity|" in captured.out
    assert "generating: 100%" in captured.err  # the scoring shows its progress (it was silent)
    scores = json.loads(out.read_text())["results"]["wikitext"]
    assert scores["num_documents"] == 1 and scores["num_tokens"] == 284
    assert 20 < scores["word_perplexity"] < 150, scores  # measured 59.1


def test_gsm8k_filters_and_normalisation() -> None:
    text = "She has 3 + 4 = 7 apples, so $1,250.\n#### 1,250."
    assert extract(text, "strict-match") == "1,250."
    assert extract(text, "flexible-extract") == "1,250."
    assert extract("The answer is 42", "strict-match") == "[invalid]"
    assert extract("The answer is 42", "flexible-extract") == "42"
    assert extract("costs $5 then -3", "flexible-extract") == "-3"
    assert extract("no numbers", "flexible-extract") == "[invalid]"
    reference = "Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18"
    assert exact_match("$18.", reference) and exact_match("18", reference)
    assert not exact_match("[invalid]", reference) and not exact_match("1.8", reference)


def test_gsm8k_prompts_as_lm_eval_builds_them(data_dir) -> None:
    train = read_jsonl(os.path.join(data_dir, "gsm8k", "train_head200.jsonl"))
    test = [{"question": "Q1?"}, {"question": "Q2?"}]
    prompts = build_prompts(test, train, 2)
    shots = random.Random(1234)
    for prompt, doc in zip(prompts, test):
        a, b = shots.sample(train, 2)
        assert prompt == (
            f"Question: {a['question']}\nAnswer: {a['answer']}\n\n"
            f"Question: {b['question']}\nAnswer: {b['answer']}\n\n"
            f"Question: {doc['question']}\nAnswer:"
        )
    assert build_prompts(test, train, 0)[0] == "Question: Q1?\nAnswer:"


def test_gsm8k_run_on_smollm2(smollm2_llm, data_dir) -> None:
    scores = run_gsm8k(smollm2_llm, data_dir, limit=2, num_fewshot=1, max_gen_toks=8)
    assert scores["num_questions"] == 2
    assert {"exact_match,strict-match", "exact_match,flexible-extract"} <= scores.keys()
    assert all(0 <= scores[k] <= 1 for k in scores if k.startswith("exact_match"))


def test_unknown_task_lists_the_known_ones(capsys) -> None:
    with pytest.raises(EvalError, match="known tasks: wikitext, gsm8k"):
        get_task("mmlu")
    assert main(["eval", "--tasks", "wikitext,mmlu"]) == 2  # before any model loads
    assert "known tasks: wikitext, gsm8k" in capsys.readouterr().err
