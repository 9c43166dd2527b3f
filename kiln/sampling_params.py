"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import InvalidRequestError


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Constrain the output to a grammar (vLLM's name and fields). Exactly one of them is set.

    json: a JSON schema (a dict or its text); regex: a regular expression the whole output
    matches; choice: the output is one of these strings; grammar: an EBNF grammar (xgrammar's
    GBNF dialect, root rule `root`); json_object: any JSON object. Compiled by
    kiln/structured_output (xgrammar), which names a bad schema or grammar in a 400.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        set_fields = [name for name in _GUIDED_KINDS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise InvalidRequestError(
                "guided_decoding needs exactly one of json, regex, choice, grammar, json_object"
                f" (got {set_fields or 'none'})",
                param="guided_decoding",
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(
                "guided_choice must be a non-empty list of non-empty strings",
                param="guided_choice",
            )

    @property
    def kind(self) -> str:
        return next(name for name in _GUIDED_KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached under: the kind and a canonical spec text."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, str):
            # Key order kept: a schema's property order is the order the grammar generates.
            return kind, _json.dumps(value)
        if kind == "choice":
            return kind, _json.dumps(list(value))
        if kind == "json_object":
            return kind, ""
        return kind, value


_GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class SamplingParams:
    """How one request is decoded. Defaults follow vLLM's `SamplingParams`.

    Validation happens in `__post_init__`, so an invalid value fails where it is written, with an
    `InvalidRequestError` naming the field.
    """

    n: int = 1
    """Number of completions to return for the prompt."""
    temperature: float = 1.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p; in (0, 1]."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; in [0, 1]."""
    repetition_penalty: float = 1.0
    """HF/CTRL-style: logits of tokens already in prompt or output are divided (or multiplied if
    negative) by it. 1.0 is off."""
    presence_penalty: float = 0.0
    """OpenAI-style: subtracted once from the logit of each token already generated."""
    frequency_penalty: float = 0.0
    """OpenAI-style: subtracted per occurrence of each token already generated."""
    seed: int | None = None
    """Seed for this request's own random stream: same seed, same output, whatever the batch."""
    max_tokens: int | None = 16
    """Most tokens to generate. None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens are generated."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation; never included in the returned text."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (in addition to the model's EOS ids)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top alternatives per step (0: only it)."""
    prompt_logprobs: int | None = None
    """Return logprobs of each prompt token and this many top alternatives (needs a recompute of
    the prompt: such requests do not read the prefix cache)."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the text."""
    include_stop_str_in_output: bool = False
    guided_decoding: GuidedDecodingParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (structured output)."""
    use_beam_search: bool = False
    """Beam search (deterministic, as HF generate(num_beams=best_of, do_sample=False)); returns
    the n best of best_of beams. Sampling fields are not used."""
    best_of: int | None = None
    """Beam width with use_beam_search (default: n)."""
    length_penalty: float = 1.0
    """Beam search: a finished beam's score is its log-probability / length ** length_penalty."""
    early_stopping: bool | str = False
    """Beam search: True stops once best_of beams have finished; False stops when no running
    beam can (heuristically) beat them; "never" only at max_tokens or by the exact bound."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.guided_decoding, dict):
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
        self._validate()

    def _validate(self) -> None:
        def fail(param: str, why: str) -> None:
            value = getattr(self, param)
            raise InvalidRequestError(f"{param} {why}, got {value!r}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if self.temperature < 0:
            fail("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail("top_k", "must be -1 (off), 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            fail("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0:
            fail("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            fail("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            fail("prompt_logprobs", "must be >= 0")
        if any(not s for s in self.stop):
            fail("stop", "must not contain empty strings")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        if self.best_of is not None and (
            not isinstance(self.best_of, int) or self.best_of < self.n
        ):
            fail("best_of", f"must be an integer >= n ({self.n})")
        if self.early_stopping not in (True, False, "never"):
            fail("early_stopping", 'must be true, false or "never"')
        if self.use_beam_search:
            if self.guided_decoding is not None:
                fail("use_beam_search", "does not combine with guided_decoding")
            if self.stop or self.logprobs is not None or self.prompt_logprobs is not None:
                fail("use_beam_search", "does not combine with stop strings or logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
