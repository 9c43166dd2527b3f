"""Structured output in the step: a grammar row's sampler waits for its allowed-token mask.

A step with grammar rows defers its sampler (StepHook.defers_sampling): a worker fills the mask
(kiln.structured_output) while the device runs the forward and the runner's thread goes on with
the engine loop; the runner launches the sampler just before the next step's forward or in
collect(), whichever comes first, with the mask as SamplingMetadata.token_bitmask.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from kiln.runtime.in_flight import InFlightStep, StepOutputs
from kiln.runtime.input_batch import CachedRequestState
from kiln.runtime.step_hooks.base import StepHook
from kiln.sampling.sampler import SamplingMetadata

if TYPE_CHECKING:
    from kiln.structured_output import GrammarBatch
    from kiln.structured_output.matchers import PendingBitmask


class GrammarMask(StepHook):
    """The runner's grammar matchers (built on the first request with a grammar) and the mask
    of the one step whose sampler waits for it."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        in_flight: deque[InFlightStep],  # the runner's submitted, uncollected steps (read only)
    ) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.device = device
        self._in_flight = in_flight
        self.grammars: GrammarBatch | None = None
        self._deferred: InFlightStep | None = None  # the step whose sampler waits for its mask
        self._fill: PendingBitmask | None = None  # its mask's fill, once started
        # Steps still in flight whose ids a fill took from their host copy itself: their tokens
        # are in the matchers already, so finish() must not queue them again.
        self._taken: set[InFlightStep] = set()

    def batch(self) -> GrammarBatch:
        if self.grammars is None:
            from kiln.structured_output import GrammarBatch, compiler_for

            compiler = compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self.grammars = GrammarBatch(compiler)
        return self.grammars

    def add_request(self, state: CachedRequestState) -> None:
        spec = state.sampling_params.guided_decoding
        if spec is not None:
            self.batch().add(state.req_id, spec, state.output_token_ids)

    def remove_request(self, req_id: str) -> None:
        # (A fill in progress holds its own matchers: removing one here does not touch it.)
        if self.grammars is not None:
            self.grammars.remove(req_id)

    def defers_sampling(self, step: InFlightStep) -> bool:
        """Grammar rows get no drafts, so none verifies here. Their mask needs the older steps'
        tokens: the fill starts from when those are on the host (now, or when the previous
        step's copy lands, which the worker waits for itself)."""
        grammars = self.grammars
        if grammars is None or not grammars.rows or not step.states:
            return False
        if not grammars.has_grammar([s.req_id for s in step.states]):
            return False
        self._deferred = step
        self._start_fill()
        return True

    def deferred_metadata(self, step: InFlightStep, metadata: SamplingMetadata) -> SamplingMetadata:
        self._start_fill()  # (the runner finished the older steps: it can start now)
        pending, self._fill, self._deferred = self._fill, None, None
        assert self.grammars is not None and pending is not None
        bitmask = self.grammars.finish_fill(pending, self.device)
        return metadata if bitmask is None else replace(metadata, token_bitmask=bitmask)

    def finish(self, step: InFlightStep, out: StepOutputs) -> None:
        if self._taken and step in self._taken:
            self._taken.discard(step)  # the fill took them already
            return
        grammars = self.grammars
        if grammars is not None and grammars.rows and step.states:
            grammars.accept_tokens([s.req_id for s in step.states], out.row_token_ids)

    def collected(self, step: InFlightStep) -> None:
        if self._deferred is not None:
            self._start_fill()  # a later step's mask may be filled from here on

    def _start_fill(self) -> None:
        """Start the deferred step's mask. Its fill needs every older step's tokens: the
        collected ones are queued in the matchers already; those of steps still in flight (the
        previous step, whose sampler was launched just before this step's forward) the worker
        takes from their host copy as soon as it lands, so the fill starts then, not when the
        runner's thread gets round to collecting them. Under TP/PP (structured output is
        refused there) a rank's ids may not be copied yet: then `collected` calls back here."""
        step = self._deferred
        if step is None or self._fill is not None:
            return
        from kiln.structured_output.matchers import IncomingTokens

        taken, incoming = [], []
        for older in self._in_flight:
            if older is step:
                break
            if older.output is not None or older.states is None:
                continue  # collected (tokens queued), or a step of prompt chunks only
            if older.arrival is not None or older.host_sampled is None:
                return
            taken.append(older)
            req_ids = [s.req_id for s in older.states]
            incoming.append(IncomingTokens(older.host_sampled, older.done, req_ids))
        self._taken.update(taken)
        assert self.grammars is not None
        req_ids = [s.req_id for s in step.states or ()]
        self._fill = self.grammars.start_fill(req_ids, self.device, incoming)
