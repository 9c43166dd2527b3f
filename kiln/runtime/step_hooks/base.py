"""The one interface between the model runner's core step and its features.

The runner (kiln.runtime.model_runner) packs a step, runs the model, makes the sampling rows'
logits, samples and copies the ids to the host; everything else a step may do is a StepHook:
speculative verification and drafting, the grammar mask, beam search's top-K, prompt logprobs,
EAGLE-3's tap of the target's hidden states, step timing (one file each in this package).

The runner calls its hooks at fixed points of every step, in this order:

    submit()   add_request / remove_request   the scheduler's new and finished requests
               before_forward                 the batch is packed; the forward is launched next
               after_forward                  the forward is launched; the states' computed
                                              token counts have not moved past it yet
               on_logits                      the sampling rows' logits; a hook may take rows
                                              out (verification) and returns the rest
               defers_sampling                True: the sampler waits for this hook's host work
               deferred_metadata              ... and is launched now, with this metadata
               sampler_launched               the sampler is queued (maybe later than submit())
               copy_to_host                   the step's device->host copies are being queued
    collect()  finish                         the ids are on the host and in the states: add
                                              this hook's part of the step's outputs
               collected                      the step's output is made

A point runs only the hooks whose class overrides it (StepHooks indexes them once), so a feature
costs a step nothing where it has nothing to do; one with work checks its own rows cheaply (a
dict of the scheduler's output, a set of request ids), never every state of the step. Hooks keep
per-step data keyed by the InFlightStep and drop it at `finish`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from kiln.runtime.in_flight import InFlightStep, StepOutputs
from kiln.runtime.input_batch import CachedRequestState, PackedBatch
from kiln.sampling.sampler import SamplingMetadata


class StepHook:
    """A feature of the runner's step. Every method here does nothing; see the module docstring
    for when the runner calls each."""

    def add_request(self, state: CachedRequestState) -> None:
        """A request the runner did not hold (new, resumed after preemption, or an id reused)."""

    def remove_request(self, req_id: str) -> None:
        """A request finished, was aborted or preempted."""

    def before_forward(self, step: InFlightStep) -> None:
        """The step's forward (or graph replay) is launched right after this."""

    def after_forward(
        self,
        step: InFlightStep,
        states: list[CachedRequestState],  # every scheduled request, in batch order
        batch: PackedBatch,
        hidden: torch.Tensor,  # [num_tokens (padded), hidden] final-normed
    ) -> None:
        """The forward is launched; `states`' num_computed_tokens are still the step's start."""

    def on_logits(self, step: InFlightStep, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the rows of `step.states` (plus any rows a hook before this one took
        out). Returns the logits the sampler gets; a hook that takes rows out narrows
        `step.states` to match."""
        return logits

    def defers_sampling(self, step: InFlightStep) -> bool:
        """True: the step's sampler waits for this hook's host work, which starts now. The
        runner launches it just before the next step's forward or in collect(), whichever comes
        first, through `deferred_metadata`."""
        return False

    def deferred_metadata(self, step: InFlightStep, metadata: SamplingMetadata) -> SamplingMetadata:
        """A deferred step's sampler is launched now, with the metadata returned."""
        return metadata

    def sampler_launched(self, step: InFlightStep) -> None:
        """The step's sampler is queued on the device (its ids' copy to the host is next)."""

    def copy_to_host(self, step: InFlightStep) -> None:
        """Queue this hook's device->host copies: the step's `done` event, recorded after,
        covers them (on the CPU the tensors are the host's already)."""

    def finish(self, step: InFlightStep, out: StepOutputs) -> None:
        """The step's ids are on the host and appended to its rows' states (`out` holds them):
        add this hook's outputs."""

    def collected(self, step: InFlightStep) -> None:
        """The step's output is made (step.times complete)."""


POINTS = tuple(
    name for name, value in vars(StepHook).items() if callable(value) and not name.startswith("_")
)
H = TypeVar("H", bound=StepHook)


class StepHooks:
    """The runner's hooks, in order, with each point's list of the hooks that override it."""

    _at_add_request: tuple[StepHook, ...]
    _at_remove_request: tuple[StepHook, ...]
    _at_before_forward: tuple[StepHook, ...]
    _at_after_forward: tuple[StepHook, ...]
    _at_on_logits: tuple[StepHook, ...]
    _at_defers_sampling: tuple[StepHook, ...]
    _at_deferred_metadata: tuple[StepHook, ...]
    _at_sampler_launched: tuple[StepHook, ...]
    _at_copy_to_host: tuple[StepHook, ...]
    _at_finish: tuple[StepHook, ...]
    _at_collected: tuple[StepHook, ...]

    def __init__(self, hooks: Sequence[StepHook] = ()) -> None:
        self.hooks: list[StepHook] = list(hooks)
        self._index()

    def _index(self) -> None:
        for point in POINTS:
            base = getattr(StepHook, point)
            at = tuple(h for h in self.hooks if getattr(type(h), point) is not base)
            setattr(self, "_at_" + point, at)

    def add(self, hook: StepHook, first: bool = False) -> None:
        self.hooks.insert(0 if first else len(self.hooks), hook)
        self._index()

    def remove(self, kind: type[StepHook]) -> None:
        self.hooks = [h for h in self.hooks if not isinstance(h, kind)]
        self._index()

    def get(self, kind: type[H]) -> H | None:
        """The hook of this class, if the runner has one."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    # ---- the points --------------------------------------------------------------------------

    def add_request(self, state: CachedRequestState) -> None:
        for hook in self._at_add_request:
            hook.add_request(state)

    def remove_request(self, req_id: str) -> None:
        for hook in self._at_remove_request:
            hook.remove_request(req_id)

    def before_forward(self, step: InFlightStep) -> None:
        for hook in self._at_before_forward:
            hook.before_forward(step)

    def after_forward(
        self,
        step: InFlightStep,
        states: list[CachedRequestState],
        batch: PackedBatch,
        hidden: torch.Tensor,
    ) -> None:
        for hook in self._at_after_forward:
            hook.after_forward(step, states, batch, hidden)

    def on_logits(self, step: InFlightStep, logits: torch.Tensor) -> torch.Tensor:
        for hook in self._at_on_logits:
            logits = hook.on_logits(step, logits)
        return logits

    def deferring(self, step: InFlightStep) -> StepHook | None:
        """The hook that defers this step's sampler, if one does."""
        for hook in self._at_defers_sampling:
            if hook.defers_sampling(step):
                return hook
        return None

    def sampler_launched(self, step: InFlightStep) -> None:
        for hook in self._at_sampler_launched:
            hook.sampler_launched(step)

    def copy_to_host(self, step: InFlightStep) -> None:
        for hook in self._at_copy_to_host:
            hook.copy_to_host(step)

    def finish(self, step: InFlightStep, out: StepOutputs) -> None:
        for hook in self._at_finish:
            hook.finish(step, out)

    def collected(self, step: InFlightStep) -> None:
        for hook in self._at_collected:
            hook.collected(step)
