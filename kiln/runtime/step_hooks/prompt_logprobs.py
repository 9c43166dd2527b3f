"""Prompt logprobs: each prompt token's logprob (and top-N) given the tokens before it."""

from __future__ import annotations

from typing import Any

import torch

from kiln.interfaces import PromptLogprobsChunk, TokenLogprobs
from kiln.runtime.in_flight import InFlightStep, StepOutputs
from kiln.runtime.input_batch import CachedRequestState, PackedBatch
from kiln.runtime.step_hooks.base import StepHook
from kiln.sampling.host_copy import to_device
from kiln.sampling.sampler import compute_logprobs, logprobs_to_lists


class PromptLogprobs(StepHook):
    """Scores the prompt tokens a step computes for the requests that asked, from the step's
    hidden states (position p's logits predict token p + 1)."""

    def __init__(self, model: Any, ops: Any, max_num_seqs: int) -> None:  # the runner's
        self.model, self.ops = model, ops
        self.max_rows = max_num_seqs
        # The requests that asked: most steps have none, and looking through every state for
        # them costs ~0.1 ms a step at 512 requests.
        self._req_ids: set[str] = set()
        self._chunks: dict[InFlightStep, dict[str, PromptLogprobsChunk]] = {}

    def add_request(self, state: CachedRequestState) -> None:
        if state.sampling_params.prompt_logprobs is not None:
            self._req_ids.add(state.req_id)
        else:  # (a request id used again)
            self._req_ids.discard(state.req_id)

    def remove_request(self, req_id: str) -> None:
        self._req_ids.discard(req_id)

    def after_forward(
        self,
        step: InFlightStep,
        states: list[CachedRequestState],
        batch: PackedBatch,
        hidden: torch.Tensor,
    ) -> None:
        if not self._req_ids or not getattr(self.model, "computes_logits", True):
            return  # none asked; or an earlier pipeline stage: no logits here
        chunks = self._score(states, batch, hidden)
        if chunks:
            self._chunks[step] = chunks

    def finish(self, step: InFlightStep, out: StepOutputs) -> None:
        if self._chunks:
            out.prompt_logprobs = self._chunks.pop(step, out.prompt_logprobs)

    def _score(
        self, states: list[CachedRequestState], batch: PackedBatch, hidden: torch.Tensor
    ) -> dict[str, PromptLogprobsChunk]:
        """Rows go through the vocabulary projection max_num_seqs at a time, so the memory this
        takes never exceeds what the startup profile measured for sampling."""
        out: dict[str, PromptLogprobsChunk] = {}
        for r, state in enumerate(states):
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            first = state.num_computed_tokens  # position of this chunk's first token
            last = min(first + batch.num_scheduled[r], len(state.prompt_token_ids) - 1)
            if last <= first:
                continue
            start = int(batch.query_start_loc_np[r])
            entries = []
            for a in range(first, last, self.max_rows):
                b = min(a + self.max_rows, last)
                chunk = hidden[start + a - first : start + b - first]
                logits = self.model.compute_logits(chunk, self.ops)
                next_ids = state.prompt_token_ids[a + 1 : b + 1]
                targets = to_device(next_ids, torch.long, logits.device)
                rows = logprobs_to_lists(compute_logprobs(logits, targets, num_top))
                entries += [TokenLogprobs(ids, lps, rank) for ids, lps, rank in rows]
            out[state.req_id] = PromptLogprobsChunk(first + 1, entries)
        return out
