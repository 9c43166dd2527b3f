"""What the runner keeps of a step between submit() and collect(), and what a step hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kiln.interfaces import (
    BeamCandidates,
    ModelRunnerOutput,
    PromptLogprobsChunk,
    SchedulerOutput,
    TokenLogprobs,
)
from kiln.runtime.input_batch import CachedRequestState
from kiln.sampling.sampler import LogprobsTensors, SamplingMetadata

if TYPE_CHECKING:
    import torch.distributed as dist

    from kiln.runtime.step_hooks.base import StepHook


@dataclass(frozen=True)
class DeferredSample:
    """A step's sampler held back by a hook (the grammar mask): what it will be launched with."""

    logits: torch.Tensor  # [sampling rows, vocab]
    metadata: SamplingMetadata  # built before the rows were marked pending
    hook: StepHook  # the hook whose host work the sampler waits for


@dataclass(eq=False)
class InFlightStep:
    """A submitted step until collect() hands its output on. Hooks keep their own per-step data
    keyed by this object (compared by identity)."""

    sched: SchedulerOutput
    graph: bool  # replayed a CUDA graph
    num_seqs: int
    states: list[CachedRequestState] | None = None  # the rows that sample, in sampled-ids order
    sampled: torch.Tensor | None = None  # [rows] on the device; set when its sampler launches
    arrival: dist.Work | None = None  # TP/PP, not the driver: the pending receive of `sampled`
    host_sampled: torch.Tensor | None = None
    host_logprobs: LogprobsTensors | None = None
    done: torch.cuda.Event | None = None  # the host copies have landed
    deferred: DeferredSample | None = None  # while its sampler waits for a hook
    # perf_counter at the phase boundaries: submit start, prepared, forward launched, sampling
    # launched; then collect start, ids back, done (kiln.runtime.step_hooks.step_timer).
    times: tuple[float, ...] = ()
    output: ModelRunnerOutput | None = None


@dataclass
class StepOutputs:
    """A step's results as the runner and its hooks fill them in, once its ids are back."""

    row_token_ids: list[int] = field(default_factory=list)  # per row of InFlightStep.states
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    beam_candidates: dict[str, BeamCandidates] = field(default_factory=dict)

    def freeze(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            self.sampled_token_ids,
            self.logprobs,
            self.prompt_logprobs,
            self.spec_token_ids,
            self.beam_candidates,
        )
