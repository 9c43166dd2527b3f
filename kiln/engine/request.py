"""The one mutable object of the control plane: a request catching its tokens up."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kiln.interfaces import BeamRow
from kiln.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # A module constant: spelling the members out looks each up on the Enum class, and this
        # is asked of every running request a step.
        return self in _FINISHED_STATUSES


_FINISHED_STATUSES = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
)


@dataclass(eq=False)
class Request:
    """A sequence whose `num_computed_tokens` catches up to `len(all_token_ids)`.

    Prefill, chunked prefill, prefix hits and recompute after preemption are all the same thing:
    computing the tokens from num_computed_tokens onward, as many as the step's budget allows.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int  # resolved: never past the model's context length
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Tokens scheduled to be sampled whose ids have not come back yet (async scheduling runs one
    # step ahead of the sampled ids; at most 2, 0 once a step's output has been applied).
    num_output_placeholders: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_preemptions: int = 0
    # Speculative decoding: drafts proposed for the next step, and the totals of this request.
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0  # verification steps (each gave accepted + 1 tokens)
    # Its KV outlives it when it finishes (not when aborted): the scheduler keeps the blocks
    # until Scheduler.fork() hands them on (beam search: the next step's beams continue it).
    retain_kv: bool = False
    # A beam-search step's row: the runner returns the search's best continuations, not logprobs.
    beam: BeamRow | None = None
    # Its LoRA adapter (kiln.lora), None for the base model; the adapter's prefix-cache root
    # (the first block's parent hash: two adapters' KV of one prompt differ, so never shared).
    lora_int_id: int | None = None
    hash_root: bytes | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens the sequence will have once every scheduled sample is back."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, float]:
        """Lower is served first (priority policy); FCFS uses arrival alone via priority 0."""
        return (self.priority, self.arrival_time)
