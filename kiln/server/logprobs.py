"""Engine logprobs (per position: token id -> Logprob) in OpenAI's two response formats.

Completions (the legacy format lm-evaluation-harness reads): parallel lists `tokens`,
`token_logprobs`, `top_logprobs` (token text -> logprob; the chosen token included, so
"was it greedy" is `token_logprob == max(top.values())`) and `text_offset`.
Chat: `content` = one entry per token with its `top_logprobs` list.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.engine.detokenizer import decode_token
from kiln.outputs import Logprob, PositionLogprobs
from kiln.tokenizer import Tokenizer

# JSON has no -inf; vLLM reports impossible tokens as -9999.0, and so do we.
_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > _FLOOR else _FLOOR


def token_text(tokenizer: Tokenizer | None, token_id: int, entry: Logprob | None = None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    if tokenizer is None:
        return f"token_id:{token_id}"
    return decode_token(tokenizer, token_id)


class CompletionLogprobs:
    """Accumulates the completions-format logprobs of one choice; `text_offset` counts from
    `start_offset` (the length of text already returned before these tokens)."""

    def __init__(self, tokenizer: Tokenizer | None, start_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.offset = start_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, position: PositionLogprobs | None) -> None:
        entry = position.get(token_id) if position else None
        text = token_text(self.tokenizer, token_id, entry)
        self.tokens.append(text)
        self.token_logprobs.append(None if entry is None else finite(entry.logprob))
        if position is None:
            self.top_logprobs.append(None)  # the first prompt token: nothing predicts it
        else:
            top: dict[str, float] = {}
            for other_id, other in position.items():
                top.setdefault(token_text(self.tokenizer, other_id, other), finite(other.logprob))
            self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)

    def extend(self, token_ids: list[int], positions: Sequence[PositionLogprobs | None]) -> None:
        for token_id, position in zip(token_ids, positions):
            self.add(token_id, position)

    def take(self) -> dict:
        """The entries added since the last take (a stream chunk), as the response object."""
        out = {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def chat_logprobs(
    tokenizer: Tokenizer | None,
    token_ids: list[int],
    positions: list[PositionLogprobs],
    num_top: int,
) -> list[dict]:
    """Chat-format `logprobs.content` entries for these tokens."""
    content = []
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id)
        text = token_text(tokenizer, token_id, entry)
        ranked = sorted(position.items(), key=lambda item: item[1].rank)
        top = [
            _chat_entry(token_text(tokenizer, tid, lp), lp.logprob)
            for tid, lp in ranked
            if lp.rank <= num_top
        ][:num_top]
        item = _chat_entry(text, entry.logprob if entry else _FLOOR)
        item["top_logprobs"] = top
        content.append(item)
    return content


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}
