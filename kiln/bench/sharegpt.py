"""vLLM's ShareGPT benchmark dataset (`--dataset-name sharegpt --dataset-path F`): a JSON list of
conversations; a request is a conversation's first turn as the prompt and its reply's token
count as the output length, sampled as vLLM's benchmark samples them (shuffled by the seed,
prompts under 4 tokens, outputs under 4, prompts over 1024 and pairs over 2048 left out), so
`vllm bench` and `kiln bench` runs on one file send the same requests."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from kiln.bench.workload import BenchRequest
from kiln.errors import KilnError

_MIN_LEN = 4
_MAX_PROMPT_LEN = 1024
_MAX_TOTAL_LEN = 2048


def sharegpt_requests(
    path: str,
    num_requests: int,
    encode: Callable[[str], list[int]],
    seed: int = 0,
    output_len: int | None = None,
) -> list[BenchRequest]:
    """`num_requests` requests from the ShareGPT file at `path`, prompts tokenized by `encode`."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        pairs = [
            (c["conversations"][0]["value"], c["conversations"][1]["value"])
            for c in data
            if len(c.get("conversations", ())) >= 2
        ]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise KilnError(f"--dataset-path {path}: not a ShareGPT JSON file ({exc})") from None
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num_requests:
            break
        ids = encode(prompt)
        n_out = len(encode(reply)) if output_len is None else output_len
        if len(ids) < _MIN_LEN or n_out < _MIN_LEN:
            continue
        if len(ids) > _MAX_PROMPT_LEN or len(ids) + n_out > _MAX_TOTAL_LEN:
            continue
        requests.append(BenchRequest(ids, n_out))
    if len(requests) < num_requests:
        raise KilnError(
            f"--dataset-path {path}: {len(requests)} usable conversations, {num_requests} asked "
            "for (ask for fewer with --num-prompts)"
        )
    return requests
