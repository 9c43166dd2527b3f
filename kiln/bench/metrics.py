"""Latency and throughput metrics as MEASURING.md defines them (the field's definitions)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestTiming:
    """Wall-clock times (seconds, one clock) of one request."""

    submitted: float
    token_times: list[float] = field(default_factory=list)  # one per generated token
    num_prompt_tokens: int = 0
    # Speculative decoding: drafts verified, accepted, and verification steps.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.submitted

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


def summarize(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 in milliseconds."""
    if not values:
        return {}
    arr = np.asarray(values) * 1000.0
    return {
        "mean_ms": float(arr.mean()),
        "p50_ms": float(np.percentile(arr, 50)),
        "p90_ms": float(np.percentile(arr, 90)),
        "p99_ms": float(np.percentile(arr, 99)),
    }


def throughput_report(timings: list[RequestTiming], num_gpus: int = 1) -> dict:
    """Output tok/s counts every generated token over first submission -> last completion."""
    start = min(t.submitted for t in timings)
    end = max(t.token_times[-1] for t in timings)
    duration = end - start
    num_out = sum(len(t.token_times) for t in timings)
    num_in = sum(t.num_prompt_tokens for t in timings)
    tpots = [t.tpot for t in timings if t.tpot is not None]
    return {
        "num_requests": len(timings),
        "duration_s": duration,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "output_tok_s": num_out / duration,
        "output_tok_s_per_gpu": num_out / duration / num_gpus,
        "total_tok_s": (num_in + num_out) / duration,
        "request_s": len(timings) / duration,
        "ttft": summarize([t.ttft for t in timings]),
        "tpot": summarize(tpots),
        "itl": summarize([x for t in timings for x in t.itls]),
        "e2e": summarize([t.e2e for t in timings]),
        **spec_decode_report(timings),
    }


def spec_decode_report(timings: list[RequestTiming]) -> dict:
    """Acceptance of speculative decoding, over all requests and per request ({} if none)."""
    drafted = sum(t.num_draft_tokens for t in timings)
    if not drafted:
        return {}
    accepted = sum(t.num_accepted_tokens for t in timings)
    steps = sum(t.num_spec_steps for t in timings)
    per_request = [
        1 + t.num_accepted_tokens / t.num_spec_steps for t in timings if t.num_spec_steps
    ]
    return {
        "spec_decode": {
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "num_verification_steps": steps,
            "acceptance_rate": accepted / drafted,
            "mean_acceptance_length": 1 + accepted / steps,
            "per_request_mean_acceptance_length": summarize_plain(per_request),
        }
    }


def summarize_plain(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values)
    return {
        "mean": float(arr.mean()),
        "min": float(arr.min()),
        "p50": float(np.percentile(arr, 50)),
        "max": float(arr.max()),
    }
