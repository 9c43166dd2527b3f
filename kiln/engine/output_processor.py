"""Turns per-step engine outputs into user-facing RequestOutputs: detokenized text, stop strings,
logprobs with token text, and the fan-in of n > 1 completions into one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.engine.detokenizer import IncrementalDetokenizer, decode_token
from kiln.engine.scheduler import EngineCoreOutput
from kiln.interfaces import TokenLogprobs
from kiln.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.tokenizer import Tokenizer


@dataclass
class _Completion:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None


@dataclass
class RequestState:
    """Everything kept for one user request (its n completions run as child requests)."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        completions = self.completions
        if len(completions) == 1:  # (n = 1, read once a step per running request)
            return completions[0].output.finish_reason is not None
        return all(c.output.finished for c in completions)

    def snapshot(self) -> RequestOutput:
        """The cumulative output so far."""
        return RequestOutput(
            request_id=self.req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_copy(c.output) for c in self.completions],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dict(self.metrics),
        )


def _copy(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(
        o.index,
        o.text,
        list(o.token_ids),
        None if o.logprobs is None else list(o.logprobs),
        o.finish_reason,
        o.stop_reason,
        cumulative_logprob=o.cumulative_logprob,
        num_draft_tokens=o.num_draft_tokens,
        num_accepted_tokens=o.num_accepted_tokens,
        num_spec_steps=o.num_spec_steps,
        error=o.error,
    )


def child_req_id(req_id: str, index: int, n: int) -> str:
    return req_id if n == 1 else f"{req_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self, req_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[str]:
        """Register a request; returns the child request ids to hand to the scheduler."""
        completions = []
        child_ids = []
        for index in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
            completions.append(_Completion(CompletionOutput(index, "", [], logprobs), detok))
            child = child_req_id(req_id, index, params.n)
            self._child_to_parent[child] = (req_id, index)
            child_ids.append(child)
        prompt_lps: list[PositionLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] * len(prompt_token_ids)
        self.requests[req_id] = RequestState(
            req_id, prompt, list(prompt_token_ids), params, completions, prompt_lps
        )
        return child_ids

    def child_ids(self, req_id: str) -> list[str]:
        state = self.requests.get(req_id)
        if state is None:
            return []
        return [child_req_id(req_id, i, state.params.n) for i in range(state.params.n)]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (delta outputs: each holds only this step's new text/tokens/logprobs of the
        completions that changed, child ids stopped by a stop string: to abort in the scheduler)."""
        deltas: dict[str, RequestOutput] = {}
        stopped: list[str] = []
        child_to_parent = self._child_to_parent
        requests = self.requests
        for out in outputs:
            parent = child_to_parent.get(out.req_id)
            if parent is None:
                continue
            req_id, index = parent
            state = requests[req_id]
            if out.num_cached_tokens > state.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                chunk = out.prompt_logprobs
                for i, entry in enumerate(chunk.entries):
                    state.prompt_logprobs[chunk.first_index + i] = self._position(entry)
            if not out.new_token_ids and out.finish_reason is None:
                continue
            completion = state.completions[index]
            delta = self._apply(completion, out)
            if completion.output.finish_reason is not None and out.finish_reason is None:
                stopped.append(out.req_id)  # a stop string ended it: the scheduler must let go
            if completion.output.finish_reason is not None:
                child_to_parent.pop(out.req_id, None)
            request_delta = deltas.get(req_id)
            if request_delta is None:
                deltas[req_id] = RequestOutput(
                    req_id,
                    state.prompt,
                    state.prompt_token_ids,
                    [delta],
                    state.finished,
                    state.prompt_logprobs,
                    state.num_cached_tokens,
                )
            else:  # another completion of the same request (n > 1)
                request_delta.outputs.append(delta)
                request_delta.finished = state.finished
        return list(deltas.values()), stopped

    def _apply(self, completion: _Completion, out: EngineCoreOutput) -> CompletionOutput:
        o = completion.output
        text = ""
        detokenizer = completion.detokenizer
        if detokenizer is not None:
            text = detokenizer.append(out.new_token_ids)
            if detokenizer.stop_string is not None:
                o.finish_reason, o.stop_reason = "stop", detokenizer.stop_string
            elif out.finish_reason is not None:
                text += detokenizer.flush()
            o.text += text
        o.token_ids.extend(out.new_token_ids)
        new_logprobs = None
        if o.logprobs is not None and out.logprobs is not None:
            new_logprobs = [self._position(entry) for entry in out.logprobs]
            o.logprobs.extend(new_logprobs)
        if o.finish_reason is None and out.finish_reason is not None:
            o.finish_reason, o.stop_reason = out.finish_reason, out.stop_reason
            o.error = out.error
        num_spec_steps = 0
        if out.num_draft_tokens:
            num_spec_steps = 1
            o.num_draft_tokens += out.num_draft_tokens
            o.num_accepted_tokens += out.num_accepted_tokens
            o.num_spec_steps += 1
        return CompletionOutput(
            o.index,
            text,
            list(out.new_token_ids),
            new_logprobs,
            o.finish_reason,
            o.stop_reason,
            None,
            out.num_draft_tokens,
            out.num_accepted_tokens,
            num_spec_steps,
            o.error,
        )

    def abort(self, req_id: str) -> RequestOutput | None:
        """Mark every unfinished completion of a request aborted; returns its final output."""
        state = self.requests.get(req_id)
        if state is None:
            return None
        for i, c in enumerate(state.completions):
            if c.output.finish_reason is None:
                c.output.finish_reason = "abort"
            self._child_to_parent.pop(child_req_id(req_id, i, state.params.n), None)
        return state.snapshot()

    def pop(self, req_id: str) -> RequestState | None:
        return self.requests.pop(req_id, None)

    def _position(self, entry: TokenLogprobs) -> PositionLogprobs:
        position: PositionLogprobs = {}
        # Column 0 is the chosen token with its true rank; the rest are the top-N in order.
        for col, (token_id, logprob) in enumerate(zip(entry.token_ids, entry.logprobs)):
            if token_id in position:
                continue
            rank = entry.rank if col == 0 else col
            text = decode_token(self.tokenizer, token_id) if self.tokenizer else None
            position[token_id] = Logprob(logprob, rank, text)
        return position
