"""Prompt lookup: the drafts are what followed the latest earlier occurrence of the request's last
n tokens (n from prompt_lookup_max down to prompt_lookup_min). No model: it pays where outputs
copy their input (summaries, edits, code, repeated passages)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kiln.spec_decode.proposer import DraftRequest, Proposer


def ngram_lookup(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix (max_n down to
    min_n tokens) that occurred before; [] if none did."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    num = tokens.shape[0]
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = tokens[num - n :]
        # Windows starting at 0 .. num - n - 1: every occurrence except the suffix itself.
        windows = sliding_window_view(tokens[: num - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        out = {}
        for request in requests:
            drafts = ngram_lookup(
                request.token_ids, self.min_n, self.max_n, self.num_speculative_tokens
            )
            if drafts:
                out[request.req_id] = drafts
        return out
