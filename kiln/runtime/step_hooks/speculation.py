"""Speculative decoding in the step: verify the scheduled drafts, then propose the next ones.

A request verifying K drafts has K + 1 logits rows (kiln.runtime.input_batch lays its tokens
out: the last known one, then the drafts). This hook takes those rows out of the step's sampling
rows and verifies them (kiln.sampling.rejection_sampler); the other rows go to the sampler
exactly as without speculation. Once the step's tokens are back, the proposer drafts each
request's next tokens (kiln.spec_decode), which the scheduler sends to verify in the next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.in_flight import InFlightStep, StepOutputs
from kiln.runtime.input_batch import CachedRequestState
from kiln.runtime.sampling_inputs import build_sampling_metadata, verification_rows
from kiln.runtime.step_hooks.base import StepHook
from kiln.sampling.host_copy import to_device
from kiln.sampling.rejection_sampler import emitted_tokens, rejection_sample
from kiln.sampling.sampler import Sampler
from kiln.spec_decode.proposer import Proposer


@dataclass
class _Verification:
    states: list[CachedRequestState]  # the requests that verify drafts, in row order
    drafts: list[int]  # per verification row: its draft (-1: the bonus row)
    accepted: torch.Tensor | None  # [rows] bool on the host; None: greedy, decided on the host
    recovered: torch.Tensor  # [rows] on the host: the token each row emits if it rejects


class DraftVerification(StepHook):
    def __init__(
        self,
        proposer: Proposer,
        sampler: Sampler,
        eos_token_ids: tuple[int, ...],
        vocab_size: int,
        device: torch.device,
        max_num_tokens: int,
        requests: dict[str, CachedRequestState],  # the runner's live requests (read only)
    ) -> None:
        self.proposer, self.sampler = proposer, sampler
        self.eos_token_ids, self.vocab_size, self.device = eos_token_ids, vocab_size, device
        self.requests = requests
        self._steps: dict[InFlightStep, _Verification] = {}
        # A greedy verification's argmax ids land in one of these (a row per verified token):
        # two, since a step's ids are copied while the previous step's are still being read.
        pin = device.type == "cuda"
        self._host = tuple(
            torch.zeros(max_num_tokens, dtype=torch.int64, pin_memory=pin) for _ in range(2)
        )
        self._slot = 0

    def add_request(self, state: CachedRequestState) -> None:
        self.proposer.remove(state.req_id)  # (resumed after preemption: its drafting restarts)

    def remove_request(self, req_id: str) -> None:
        self.proposer.remove(req_id)

    def on_logits(self, step: InFlightStep, logits: torch.Tensor) -> torch.Tensor:
        """Verify the requests with drafts (rejection sampling over their K + 1 rows each);
        returns the other rows' logits and narrows step.states to them.

        Nothing here waits for the device: torch.tensor(list, device="cuda") copies from
        pageable memory and synchronises the stream, which held the host until the forward had
        finished and then left the GPU idle between the small kernels after it."""
        if not step.sched.scheduled_spec_decode_tokens:
            return logits
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        spec_states: list[CachedRequestState] = []
        plain_states: list[CachedRequestState] = []
        row = 0
        for state in step.states or ():
            n = len(state.spec_token_ids) + 1 if state.spec_token_ids else 1
            if state.spec_token_ids:
                spec_rows.extend(range(row, row + n))
                spec_states.append(state)
            else:
                plain_rows.append(row)
                plain_states.append(state)
            row += n
        step.states = plain_states
        device = logits.device
        # Every row verifies (a batch of speculating decodes): no gather.
        spec_logits = logits[to_device(spec_rows, torch.long, device)] if plain_rows else logits
        drafts = [d for s in spec_states for d in (*s.spec_token_ids, -1)]
        accepted = None
        if all(s.plain_greedy for s in spec_states):
            # The common case. A greedy row accepts its draft iff it is the argmax, and emits the
            # argmax where it rejects (or at the bonus row): the argmax ids decide everything,
            # compared with the drafts on the host once they are back. One kernel and one copy,
            # as a plain decode's sampling.
            recovered = self._to_host(self.sampler.argmax(spec_logits))
        else:
            rows = verification_rows(spec_states)
            metadata = build_sampling_metadata(rows, self.eos_token_ids, self.vocab_size, device)
            greedy, probs = self.sampler.target_distribution(spec_logits, metadata)
            accepted, recovered = rejection_sample(
                drafts, greedy, probs, metadata.temperature == 0, metadata.generators
            )
            accepted = accepted.to("cpu", non_blocking=True)
            recovered = recovered.to("cpu", non_blocking=True)
        self._steps[step] = _Verification(spec_states, drafts, accepted, recovered)
        for state in spec_states:
            state.num_pending += 1
        if not plain_rows:
            return logits[:0]
        return logits[to_device(plain_rows, torch.long, device)]

    def _to_host(self, ids: torch.Tensor) -> torch.Tensor:
        """Start the copy of a greedy verification's ids into a pinned buffer (no pinned
        allocation a step). Waited for by the step's `done` event, recorded after."""
        if self.device.type != "cuda":
            return ids
        self._slot ^= 1
        host = self._host[self._slot]
        if ids.shape[0] > host.shape[0]:  # cannot happen (a row per token); never truncate
            return ids.to("cpu", non_blocking=True)
        host = host[: ids.shape[0]]
        host.copy_(ids, non_blocking=True)
        return host

    def finish(self, step: InFlightStep, out: StepOutputs) -> None:
        verification = self._steps.pop(step, None) if self._steps else None
        if verification is not None:
            self._emit(verification, out)
        if step.states is None:
            return
        # Drafts only for requests without logprobs (their drafts' logprobs are not built)
        # and without a grammar (drafts are not checked against it).
        verified = verification.states if verification is not None else ()
        wanting = [
            s
            for s in (*step.states, *verified)
            if s.sampling_params.logprobs is None
            and s.sampling_params.guided_decoding is None
            and s.req_id not in step.sched.beam_rows  # (one token each: nothing to draft)
            and s.req_id in self.requests
        ]
        if wanting:
            out.spec_token_ids = self.proposer.propose(wanting)

    def _emit(self, verification: _Verification, out: StepOutputs) -> None:
        """Each verifying request's accepted drafts and the token after them, into its state."""
        recovered = verification.recovered.tolist()
        drafts = verification.drafts
        if verification.accepted is None:  # greedy: accepted where the draft is the argmax
            accepted = [d == g for d, g in zip(drafts, recovered)]
        else:
            accepted = verification.accepted.tolist()
        states = verification.states
        num_drafts = [len(s.spec_token_ids) for s in states]
        if self.proposer.decides_acceptance:  # the speed benchmark's oracle: its draw decides
            accepted = self.proposer.accepted_rows([s.req_id for s in states], num_drafts)
        for state, tokens in zip(states, emitted_tokens(num_drafts, drafts, accepted, recovered)):
            state.output_token_ids.extend(tokens)
            state.token_ids.extend(tokens)
            state.num_pending -= 1
            out.sampled_token_ids[state.req_id] = tokens
