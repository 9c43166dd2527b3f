"""The `gsm8k` task: lm-eval's GSM8K exact match (lm_eval/tasks/gsm8k/gsm8k.yaml, version 3).

Prompt: `num_fewshot` solved train questions, each "Question: {q}\\nAnswer: {a}\\n\\n", then
"Question: {q}\\nAnswer:". lm-eval draws each test question's shots with one
`random.Random(1234)` (its `fewshot_random_seed`) consumed in test order, `rnd.sample(train, k)`;
the same draw from the shared data's first 200 train questions matches an lm-eval run whose
local task file points its train split at that file. Greedy decoding up to 256 tokens (lm-eval's
`max_gen_toks`), stopped at "Question:", "</s>" or "<|im_end|>".
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Sequence

from kiln.errors import EvalError
from kiln.sampling_params import SamplingParams

STOP = ["Question:", "</s>", "<|im_end|>"]
FEWSHOT_SEED = 1234
MAX_GEN_TOKS = 256
FALLBACK = "[invalid]"
# filter name -> (pattern, which match: lm-eval's group_select)
FILTERS = {
    "strict-match": (re.compile(r"#### (\-?[0-9\.\,]+)"), 0),
    "flexible-extract": (re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)"), -1),
}
# exact_match's options in the yaml: ignore_case true, ignore_punctuation false.
REGEXES_TO_IGNORE = [",", r"\$", r"(?s).*#### ", r"\.$"]


def extract(text: str, filter_name: str) -> str:
    """lm-eval's `regex` filter then `take_first`: the selected match (the first non-empty group
    of a multi-group pattern), stripped, or "[invalid]"."""
    pattern, group_select = FILTERS[filter_name]
    matches = pattern.findall(text)
    if not matches:
        return FALLBACK
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), FALLBACK)
    return match.strip()


def normalize(text: str) -> str:
    """exact_match's normalisation, applied to prediction and reference alike."""
    for pattern in REGEXES_TO_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def exact_match(prediction: str, reference: str) -> bool:
    return normalize(prediction) == normalize(reference)


def format_prompt(question: str, shots: Sequence[dict]) -> str:
    fewshot = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
    return f"{fewshot}Question: {question}\nAnswer:"


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise EvalError(f"gsm8k: {path} not found")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_prompts(test: Sequence[dict], train: Sequence[dict], num_fewshot: int) -> list[str]:
    if num_fewshot > len(train):
        raise EvalError(f"gsm8k: {num_fewshot} shots asked, {len(train)} train questions held")
    rnd = random.Random(FEWSHOT_SEED)
    return [
        format_prompt(doc["question"], rnd.sample(list(train), num_fewshot) if num_fewshot else [])
        for doc in test
    ]


def run(
    llm,
    data_dir: str,
    limit: int | None = None,
    num_fewshot: int | None = None,
    max_gen_toks: int = MAX_GEN_TOKS,
    **_: object,
) -> dict[str, float]:
    """Exact match under both filters on the first `limit` test questions."""
    test = read_jsonl(os.path.join(data_dir, "gsm8k", "test.jsonl"))[:limit]
    train = read_jsonl(os.path.join(data_dir, "gsm8k", "train_head200.jsonl"))
    prompts = build_prompts(test, train, 5 if num_fewshot is None else num_fewshot)
    params = SamplingParams(temperature=0, max_tokens=max_gen_toks, stop=STOP)
    outputs = llm.generate(prompts, params, use_tqdm=True)
    texts = [o.outputs[0].text for o in outputs]
    scores: dict[str, float] = {}
    for name in FILTERS:
        hits = [exact_match(extract(t, name), d["answer"]) for t, d in zip(texts, test)]
        scores[f"exact_match,{name}"] = sum(hits) / len(hits)
    scores["num_questions"] = len(test)
    return scores
