"""What crosses between the control plane and the data plane, in one small module both import.

The scheduler (engine/) produces a `SchedulerOutput` per step; the executor and model runner
(executor/, runtime/) answer with a `ModelRunnerOutput`; the KV cache manager (kv_cache/) sees a
request only through `KVCacheRequest`. Plain frozen dataclasses and a protocol, no torch: the
arrows run one way (engine -> executor -> runtime -> models -> kernels), and the scheduler and the
KV manager are unit-tested with hand-made values of these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kiln.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption), sent in full."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # A hybrid model's KV cache groups (kiln.models.kv_groups): each group's ids in turn, all
    # of one length (the runner splits them); one group: simply its blocks.
    block_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int | None = None  # its LoRA adapter (resident in a slot while it runs)


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]  # (several KV cache groups: as NewRequestData.block_ids)
    num_computed_tokens: int


@dataclass(frozen=True)
class BeamRow:
    """A row of a beam-search step (kiln.engine.beam_search): the runner turns its logits into
    the search's best continuations on the device (kiln.sampling.beam), so only those come back."""

    search_id: str
    beam: int  # which running beam of the search this row continues
    score: float  # that beam's cumulative log-probability (an fp32 value)
    keep: int  # continuations the search keeps per step (HF's beams_to_keep)
    num_beams: int  # the search's rows this step: all in one step -> one top-`keep` over them


@dataclass(frozen=True)
class BeamCandidates:
    """A beam-search step's best continuations over some of its rows (all of them, when the step
    held them all), best first: the cumulative fp32 log-probability, the beam each continues and
    its next token."""

    scores: list[float]
    beams: list[int]
    token_ids: list[int]


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Finished, aborted or preempted since the last step: the runner drops their state.
    finished_req_ids: frozenset[str]
    num_preempted: int = 0
    step_id: int = 0  # increasing: lets update() tell a request from a later one of the same id
    # Speculative decoding: a decode's draft tokens, scheduled as extra tokens of the request
    # (its num_scheduled_tokens is 1 + len(drafts)); the runner verifies them in the same pass.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Copy-on-write forks (KVCacheManager.fork): (source, destination) KV block ids whose
    # contents the runner copies, in every layer, before this step's forward.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Beam-search rows of this step, by request id (the driver's runner alone reads them: the
    # other ranks' runners return no sampled values, so the rank message leaves them out).
    beam_rows: dict[str, BeamRow] = field(default_factory=dict)
    # LoRA (kiln.lora.slots): (slot, adapter id) loads the runner performs, in order, before
    # this step's forward; every scheduled request's adapter is resident by then.
    lora_loads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one position: column 0 is the chosen token, then the top-N alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of token_ids[0] (1 = most likely)


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """Logprobs of prompt tokens first_index .. first_index + len(entries) - 1, scored this step.
    (The first prompt token has none: nothing predicts it.)"""

    first_index: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results. A request that samples gets a list of tokens: one today; several when
    a step verifies drafted tokens (speculative decoding), each checked for stops in order."""

    sampled_token_ids: dict[str, list[int]]  # requests that reached their last token this step
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per sampled id
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Speculative decoding: draft tokens proposed for each request's next step (kiln.spec_decode).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Beam search: each step group's best continuations, under the request id of its first row.
    beam_candidates: dict[str, BeamCandidates] = field(default_factory=dict)


EMPTY_RUNNER_OUTPUT = ModelRunnerOutput(sampled_token_ids={})


class KVCacheRequest(Protocol):
    """What the KV cache manager reads (and, for block_hashes, extends) of a request."""

    req_id: str
    sampling_params: SamplingParams
    num_computed_tokens: int
    block_hashes: list[bytes]  # chained hashes of its full blocks, filled by the manager
    hash_root: bytes | None  # the first block's parent hash (a LoRA adapter's); None: the base's

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...
