"""`SpeculativeConfig`: vLLM's `speculative_config` dict, validated, plus the K-by-batch policy.

Pure Python (no torch): the engine and the CLI read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol

from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.spec_decode.proposer import Proposer

METHODS = ("ngram", "draft_model", "eagle3")
# More drafts per step than any method verifies usefully (acceptance falls geometrically with K);
# the step's buffers are sized by it.
MAX_SPECULATIVE_TOKENS = 64


class ProposerInstrument(Protocol):
    """A measuring instrument that stands in for a method's proposer (kiln.bench.oracle)."""

    def build(self, num_speculative_tokens: int, vocab_size: int) -> Proposer: ...


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    """"ngram" (prompt lookup), "draft_model" (a smaller model of the same vocabulary) or
    "eagle3" (an EAGLE-3 head over the target's hidden states)."""
    num_speculative_tokens: int
    """K: drafts verified per decode step (at most; the policy may lower it by batch size)."""
    model: str | None = None
    """The draft model (draft_model): an HF directory or .gguf file; eagle3: the head's directory
    (the published EAGLE-3 layout, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix that is looked up in the request's earlier tokens."""
    prompt_lookup_max: int = 5
    """ngram: the longest suffix tried first (a longer match predicts better)."""
    draft_num_hidden_layers: int | None = None
    """draft_model: keep only the draft's first N decoder layers (a layer-truncated draft)."""
    num_speculative_tokens_by_batch_size: dict[int, int] | None = None
    """Policy override: {batch size: K}, read as "up to this many running requests, K drafts";
    past the largest key, no drafts. None: the default policy (see `num_tokens_for_batch`)."""
    disable_by_batch_size: int | None = None
    """vLLM's switch: no drafts while more than this many requests run."""
    instrument: ProposerInstrument | None = field(default=None, metadata={"internal": True})
    """Internal to kiln bench and the tests, never read from a dict: a measuring instrument
    built in place of the method's proposer (kiln.bench.oracle.oracle_config), `method` then
    only its name. Its output need not be the model's text, so no user setting reaches it."""

    def __post_init__(self) -> None:
        def fail(name: str, why: str) -> None:
            raise ConfigError(f"speculative_config.{name} {why}, got {getattr(self, name)!r}")

        def integer(name: str, low: int, high: int | None = None, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                fail(name, f"must be an integer >= {low}")
            if high is not None and value > high:
                fail(name, f"must be at most {high}")

        if self.instrument is None and self.method not in METHODS:
            fail("method", "must be one of " + ", ".join(f'"{m}"' for m in METHODS))
        integer("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        if self.model is not None and not isinstance(self.model, str):
            fail("model", "must be a path or a hub id")
        if self.instrument is None and self.method in ("draft_model", "eagle3") and not self.model:
            fail("model", f'must name the draft model for method "{self.method}"')
        integer("prompt_lookup_min", 1)
        integer("prompt_lookup_max", 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            fail("prompt_lookup_min", "must be >= 1 and <= prompt_lookup_max")
        integer("draft_num_hidden_layers", 1, optional=True)
        integer("disable_by_batch_size", 1, optional=True)
        table = self.num_speculative_tokens_by_batch_size
        if table is not None and (
            not isinstance(table, dict)
            or not table
            or any(b < 1 or k < 0 for b, k in table.items())
        ):
            fail("num_speculative_tokens_by_batch_size", "must map batch sizes >= 1 to K >= 0")

    @classmethod
    def from_dict(cls, value: dict | SpeculativeConfig) -> SpeculativeConfig:
        """A dict's keys are the public fields; a SpeculativeConfig (an instrument's, made in
        Python) is taken as it is."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict, got {value!r}")
        known = {f.name for f in fields(cls) if not f.metadata.get("internal")}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ConfigError(f"speculative_config.{key} is required")
        value = dict(value)
        # vLLM accepts "draft_model" under the older name too; a model alone means a draft model.
        table = value.get("num_speculative_tokens_by_batch_size")
        if table is not None:
            try:
                value["num_speculative_tokens_by_batch_size"] = {
                    int(b): int(k) for b, k in table.items()
                }
            except (AttributeError, TypeError, ValueError):
                raise ConfigError(
                    "speculative_config.num_speculative_tokens_by_batch_size must map batch "
                    f"sizes to K, got {table!r}"
                ) from None
        return cls(**value)

    def num_tokens_for_batch(self, batch_size: int) -> int:
        """How many drafts a decode verifies when `batch_size` requests run. Speculation pays
        while a step is bound by reading the weights (small batches) and costs compute past it,
        so K falls with the batch: the default keeps K up to 32 running requests, half of it up to
        64 and none beyond. Measured on an H200 at Llama-3.1-8B shapes, K = 4: a verification step
        costs 1.3x a plain step at 32 requests, 2.0x at 64, 3.0x at 128, so at mean acceptance
        length 3 speculation gives 2.0x / 1.4x / 0.95x; half K keeps 64 requests paying at the lower
        acceptance a real drafter has there."""
        k = self.num_speculative_tokens
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return 0
        table = self.num_speculative_tokens_by_batch_size
        if table is not None:
            for limit in sorted(table):
                if batch_size <= limit:
                    return min(k, table[limit])
            return 0
        if batch_size <= 32:
            return k
        if batch_size <= 64:
            return math.ceil(k / 2)
        return 0
