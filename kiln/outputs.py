"""What the engine hands back to users: the shapes known from vLLM's and TensorRT-LLM's LLM APIs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token, its rank in the vocabulary (1 = most likely), its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position: token id -> Logprob, holding the chosen token and the top-N alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    """'stop' (EOS, stop token or stop string), 'length' (max_tokens or context), 'abort',
    'error' (see `error`), or None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the completion, if any."""
    cumulative_logprob: float | None = None
    """Sum of the tokens' log-probabilities; set by beam search (its beam's score before the
    length penalty)."""
    num_draft_tokens: int = 0
    """Speculative decoding: drafts verified (in a delta: this step's)."""
    num_accepted_tokens: int = 0
    """Speculative decoding: drafts accepted."""
    num_spec_steps: int = 0
    """Speculative decoding: verification steps (each emits its accepted drafts plus one)."""
    error: str | None = None
    """With finish_reason 'error': what went wrong (a grammar that failed to compile after its
    spec was accepted); the server answers that request with an error."""

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification step (1 + accepted / steps, vLLM's definition); None if no
        step verified drafts."""
        if not self.num_spec_steps:
            return None
        return 1 + self.num_accepted_tokens / self.num_spec_steps

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
