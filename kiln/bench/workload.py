"""Synthetic benchmark requests, as trtllm-bench prepares them: random token ids, seeded."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def parse_len(spec: str) -> tuple[int, int]:
    """ "128" -> (128, 128); "32:512" -> uniform between 32 and 512 inclusive."""
    lo, _, hi = spec.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise ValueError(f"length spec {spec!r} must be N or LOW:HIGH with 1 <= LOW <= HIGH")
    return low, high


def synthetic_requests(
    num_requests: int,
    input_len: str,
    output_len: str,
    vocab_size: int,
    seed: int = 0,
    avoid_ids: tuple[int, ...] = (),
) -> list[BenchRequest]:
    """Random token ids (special ids avoided) with fixed or uniformly drawn lengths."""
    rng = random.Random(seed)
    in_lo, in_hi = parse_len(input_len)
    out_lo, out_hi = parse_len(output_len)
    avoid = set(avoid_ids)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(in_lo, in_hi)
        ids: list[int] = []
        while len(ids) < n_in:
            t = rng.randrange(3, vocab_size)
            if t not in avoid:
                ids.append(t)
        requests.append(BenchRequest(ids, rng.randint(out_lo, out_hi)))
    return requests


def benchmark_requests(
    args: argparse.Namespace,
    num_requests: int,
    vocab_size: int,
    seed: int,
    avoid_ids: tuple[int, ...],
    encode: Callable[[], Callable[[str], list[int]]],
) -> list[BenchRequest]:
    """The bench's requests: vLLM's ShareGPT file when `args.dataset_name` is "sharegpt"
    (`encode()` gives the tokenizer's encode, asked for only then), else synthetic ones."""
    if getattr(args, "dataset_name", "random") == "sharegpt":
        from kiln.bench.sharegpt import sharegpt_requests

        path = args.dataset_path
        return sharegpt_requests(
            path, num_requests, encode(), seed, getattr(args, "sharegpt_output_len", None)
        )
    return synthetic_requests(
        num_requests,
        args.input_len,
        args.output_len,
        vocab_size,
        seed,
        avoid_ids,
    )
