"""lm-evaluation-harness, unmodified, against `kiln serve`: `local-completions` (a generation, a
multiple-choice and a rolling-loglikelihood task, kiln's remote tokenizer endpoints) and
`local-chat-completions` (the generation task through the chat template), on the local task
files in tests/data/lm_eval/. Every number lm-eval reports is checked against kiln's offline API
on the very same engine: its generations token for token, its loglikelihoods to 1e-4."""

from __future__ import annotations

import math
import pathlib
import re
import string

import pytest

from kiln.sampling_params import SamplingParams
from kiln.server.app import build_app
from tests.server_harness import MODEL_NAME, ServerThread, offline, shared_engine

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")

_REPO = pathlib.Path(__file__).resolve().parents[2]
_TASKS = _REPO / "tests" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def server():
    engine = shared_engine()
    with ServerThread(build_app(engine, MODEL_NAME)) as srv:
        yield engine, srv


def _evaluate(model: str, model_args: str, tasks: list[str], **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(_TASKS)),
        log_samples=True,
        limit=2,
        **kwargs,
    )


def _loglikelihood(llm, context_ids: list[int], continuation_ids: list[int]) -> float:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    (out,) = llm.generate(context_ids + continuation_ids, params)
    positions = out.prompt_logprobs[len(context_ids) :]
    return sum(
        lp[t].logprob for lp, t in zip(positions, continuation_ids, strict=True)
    )  # the logprob of the actual token at each position


def test_local_completions_generation_choices_and_rolling(server, monkeypatch):
    engine, srv = server
    monkeypatch.chdir(_REPO)  # the task files name their data relative to the checkout
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = (
        f"base_url={srv.base_url}/v1/completions,model={MODEL_NAME},"
        "tokenizer_backend=remote,max_length=256,num_concurrent=1,max_retries=1"
    )
    results = _evaluate("local-completions", args, ["kiln_gen", "kiln_mc", "kiln_rolling"])
    samples = results["samples"]
    assert [len(samples[t]) for t in ("kiln_gen", "kiln_mc", "kiln_rolling")] == [2, 2, 2]

    def reference(llm):
        tok = llm.get_tokenizer()
        gen = [
            llm.generate(
                s["arguments"][0][0],
                SamplingParams(temperature=0, max_tokens=12, stop=["\n", "<|im_end|>"]),
            )[0]
            .outputs[0]
            .text
            for s in samples["kiln_gen"]
        ]
        choices = []
        for s in samples["kiln_mc"]:
            per_choice = []
            for context, continuation in s["arguments"]:
                # lm-eval's split: trailing spaces of the context go with the continuation, and
                # the continuation's ids are the whole's beyond the context's.
                spaces = len(context) - len(context.rstrip())
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                whole = tok.encode(context + continuation, add_special_tokens=False)
                ctx = tok.encode(context, add_special_tokens=False)
                per_choice.append(_loglikelihood(llm, ctx, whole[len(ctx) :]))
            choices.append(per_choice)
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        rolling = [
            _loglikelihood(llm, [prefix], tok.encode(s["doc"]["text"], add_special_tokens=False))
            for s in samples["kiln_rolling"]
        ]
        return gen, choices, rolling

    gen, choices, rolling = offline(engine, reference)
    for sample, text in zip(samples["kiln_gen"], gen, strict=True):
        assert sample["resps"][0][0] == text
    # exact_match as lm-eval's metric defines it here: case and punctuation ignored, no strip.
    plain = lambda t: t.lower().translate(str.maketrans("", "", string.punctuation))
    matches = [plain(t) == plain(s["target"]) for t, s in zip(gen, samples["kiln_gen"])]
    assert results["results"]["kiln_gen"]["exact_match,none"] == sum(matches) / len(matches)
    correct = 0
    for sample, want in zip(samples["kiln_mc"], choices, strict=True):
        got = [r[0][0] for r in sample["resps"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
        correct += max(range(len(want)), key=want.__getitem__) == sample["doc"]["label"]
    assert results["results"]["kiln_mc"]["acc,none"] == pytest.approx(correct / len(choices))
    words = sum(len(re.split(r"\s+", s["doc"]["text"])) for s in samples["kiln_rolling"])
    want_ppl = math.exp(-sum(rolling) / words)
    got_ppl = results["results"]["kiln_rolling"]["word_perplexity,none"]
    assert got_ppl == pytest.approx(want_ppl, rel=1e-4)
    assert 1 < got_ppl < 1e4


def test_local_chat_completions_generation(server, monkeypatch):
    engine, srv = server
    monkeypatch.chdir(_REPO)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    args = (
        f"base_url={srv.base_url}/v1/chat/completions,model={MODEL_NAME},"
        "num_concurrent=1,max_retries=1"
    )
    results = _evaluate("local-chat-completions", args, ["kiln_gen"], apply_chat_template=True)
    samples = results["samples"]["kiln_gen"]
    assert len(samples) == 2

    def reference(llm):
        params = SamplingParams(temperature=0, max_tokens=12, stop=["\n", "<|im_end|>"])
        texts = []
        for s in samples:
            messages = eval_messages(s["arguments"][0][0])
            texts.append(llm.chat(messages, params)[0].outputs[0].text)
        return texts

    for sample, text in zip(samples, offline(engine, reference), strict=True):
        assert sample["resps"][0][0] == text


def eval_messages(rendered: object) -> list[dict]:
    """lm-eval hands the chat model its messages as a JSON string (a JsonChatStr)."""
    import json

    if isinstance(rendered, (tuple, list)):  # a JsonChatStr named tuple, as logged
        rendered = rendered[0]
    return json.loads(getattr(rendered, "prompt", rendered))
