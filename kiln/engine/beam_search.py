"""Beam search above the scheduler: each step, every running beam is one ordinary request of one
token, so beams batch with every other request; its row carries the beam's score
(interfaces.BeamRow), and the runner sends back the search's K best continuations, selected on
the device (kiln.sampling.beam), not log-probabilities over the vocabulary. A step's
beams continue the previous step's by copy-on-write forks: a finished beam request keeps its KV
(Request.retain_kv) until the selection is made, then each beam that continues it gets its
blocks (Scheduler.fork: the full ones shared by reference, the last partial one copied on the
device), so the next step computes one token a beam, a plain decode row (CUDA graphs on the GPU).
Nothing outlives a step but those retained blocks, which the search lets go of when it forks,
finishes or is aborted: an abort frees every block.

The selection is Hugging Face's `generate(num_beams=W, do_sample=False, length_penalty,
early_stopping)` step for step (transformers' _beam_search): the top K = max(2, 1 + #EOS) * W
continuations over all beams by cumulative fp32 log-probability (on the device); those ending
in EOS or at max_tokens finish, if among the top W, with score logprob / generated_len **
length_penalty; the best W others run on; the early-stopping heuristic and `early_stopping`
True / False / "never" as HF's. The host's part is K candidates a step, in fp32 (Python
floats rounded to fp32 after every op: the result of HF's torch fp32 op, at a fraction of its
per-call cost: the host time of a beam step is not hidden behind the device, as the next step
waits for the selection).
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.engine.hooks import EngineHook, NewRequest
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import EngineCoreOutput
from kiln.interfaces import BeamRow, ModelRunnerOutput
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.engine.llm_engine import LLMEngine

NEG = -1.0e9  # HF's "impossible" score (an fp32 value)


@dataclass
class _Beam:
    tokens: list[int]
    score: float  # cumulative log-probability, an fp32 value (HF's arithmetic)


def _fp32(values: list[float]) -> list[float]:
    """Each value rounded to the nearest fp32. An op on fp32 values done in Python's doubles, then
    rounded so, is the fp32 op's result (a double holds more than 2 x 24 + 2 bits, so rounding
    twice gives the correctly rounded +, -, x, /): what torch's fp32 ops compute."""
    return array("f", values).tolist()


@dataclass
class BeamSearchState:
    """One search's beams. Scores are fp32 values kept as Python floats (exact): the arithmetic
    runs as HF's, in fp32 (each op's result rounded by _fp32; a Python float operand, such as
    torch casts to the tensor's fp32, rounded first)."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int
    width: int
    running: list[_Beam] = field(default_factory=list)
    finished: list[tuple[float, bool, list[int], float]] = field(default_factory=list)
    """W slots of (penalized score, is finished, tokens, cumulative logprob), best first."""
    priority: int = 0
    arrival_time: float = 0.0  # the search's: its beams keep its place in the queue
    unsatisfied: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    step: int = 0
    children: dict[str, int] = field(default_factory=dict)  # child id -> running beam index
    num_back: int = 0  # children whose candidates are in
    candidates: list[tuple[float, int, int]] = field(default_factory=list)  # (score, beam, token)
    parents: list[int] = field(default_factory=list)  # running beam -> its beam of the last step

    @property
    def keep(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def __post_init__(self) -> None:
        # Beams 1.. start at -1e9, so the first step expands beam 0 alone (as HF).
        self.running = [_Beam([], 0.0 if i == 0 else NEG) for i in range(self.width)]
        self.finished = [(NEG, False, [], NEG) for _ in range(self.width)]

    def advance(self) -> bool:
        """One HF step from the children's candidates (their accumulated fp32 scores, each row's
        or the search's top K, from the device); True when the search is over."""
        W, K = self.width, self.keep
        generated = self.step + 1  # tokens each candidate has (cur_len + 1 - prompt_len)
        # HF's top K over W x vocab: ties in the flat (beam, token) order.
        top = sorted(self.candidates, key=lambda c: (-c[0], c[1], c[2]))[:K]
        self.candidates, self.num_back = [], 0
        acc = [c[0] for c in top]  # fp32 values
        eos, max_tokens = self.eos_token_ids, self.max_tokens
        hit_list = [token in eos or generated >= max_tokens for _, _, token in top]

        def tokens(i: int) -> list[int]:  # (built only for the candidates that are kept)
            _, beam, token = top[i]
            return [*self.running[beam].tokens, token]

        # Running beams for the next step: the best W that did not just finish.
        running_scores = _fp32([a + NEG if hit else a for a, hit in zip(acc, hit_list)])
        alive = sorted(range(len(top)), key=lambda i: (-running_scores[i], i))[:W]
        new_running = [_Beam(tokens(i), running_scores[i]) for i in alive]
        self.parents = [top[i][1] for i in alive]
        # Finished hypotheses: the top-W candidates that hit a stop, length-penalized.
        all_finished = all(f[1] for f in self.finished)
        lp = self.params.length_penalty
        done = [hit and i < W for i, hit in enumerate(hit_list)]
        [divisor] = _fp32([generated**lp])
        score = _fp32([a / divisor for a in acc])
        if all_finished and self.params.early_stopping is True:
            score = _fp32([x + NEG for x in score])
        if not self.unsatisfied:
            score = _fp32([x + NEG for x in score])
        score = _fp32([x if d else x + NEG for x, d in zip(score, done)])
        merged = [f[0] for f in self.finished] + score
        order = sorted(range(len(merged)), key=lambda i: (-merged[i], i))[:W]
        self.finished = [
            self.finished[i] if i < W else (score[i - W], done[i - W], tokens(i - W), acc[i - W])
            for i in order
        ]
        self.running = new_running
        self.step += 1
        # HF's early-stopping heuristic, then its loop condition.
        if self.params.early_stopping == "never" and lp > 0.0:
            best_len = self.max_tokens
        else:
            best_len = self.step
        [divisor] = _fp32([best_len**lp])
        [best_running] = _fp32([self.running[0].score / divisor])
        worst = min(f[0] for f in self.finished)
        worst_finished = [worst if f[1] else NEG for f in self.finished]
        self.unsatisfied = self.unsatisfied and any(best_running > w for w in worst_finished)
        open_beam = not (all(f[1] for f in self.finished) and self.params.early_stopping is True)
        return not (self.unsatisfied and open_beam and not all(hit_list))


class BeamSearchManager(EngineHook):
    """The engine's beam searches (an EngineHook): serves each request with use_beam_search,
    queues each step's beams in the scheduler, takes their outputs before the output processor
    (a beam's one token is not a user's) and forks the next step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.searches: dict[str, BeamSearchState] = {}
        self._child_to_search: dict[str, str] = {}
        self._child_params: dict[str, SamplingParams] = {}  # search id -> its beams' params
        self._done: dict[str, RequestOutput] = {}

    @property
    def active(self) -> bool:
        return bool(self.searches)

    def has_work(self) -> bool:
        return self.active

    def add_request(self, new: NewRequest) -> bool:
        params = new.params
        if not params.use_beam_search:
            return False
        req_id, token_ids = new.request_id, new.prompt_token_ids
        width = params.best_of or params.n
        state = BeamSearchState(
            req_id,
            new.prompt,
            token_ids,
            params,
            self.engine.eos_token_ids,
            new.max_tokens,
            width,
            priority=new.priority,
            arrival_time=time.monotonic(),
        )
        self._child_params[req_id] = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            ignore_eos=True,
            skip_special_tokens=params.skip_special_tokens,
        )
        self.searches[req_id] = state
        # The first step expands beam 0 alone (the others are the same prompt at -1e9): the
        # prompt's prefill, prefix-cache hits included.
        self.engine.scheduler.add_request(self._child(state, 0, token_ids, 1))
        return True

    def _child(
        self, state: BeamSearchState, beam: int, token_ids: list[int], num_beams: int
    ) -> Request:
        """The request that computes one step of a running beam (`num_beams` in the step)."""
        child_id = f"{state.req_id}#beam{state.step}.{beam}"
        state.children[child_id] = beam
        self._child_to_search[child_id] = state.req_id
        return Request(
            child_id,
            token_ids,
            self._child_params[state.req_id],
            state.eos_token_ids,
            max_tokens=1,
            priority=state.priority,
            arrival_time=state.arrival_time,
            retain_kv=True,
            beam=BeamRow(state.req_id, beam, state.running[beam].score, state.keep, num_beams),
        )

    def _issue(self, state: BeamSearchState) -> None:
        """Queue the step's beams, each forked from the request that ran its parent beam."""
        ran = {beam: child_id for child_id, beam in state.children.items()}
        forks: dict[str, list[Request]] = {child_id: [] for child_id in state.children}
        state.children = {}
        num_beams = len(state.running)
        for index, beam in enumerate(state.running):
            tokens = state.prompt_token_ids + beam.tokens
            forks[ran[state.parents[index]]].append(self._child(state, index, tokens, num_beams))
        # Beams nobody continues first: their partial blocks go back before the copies are taken.
        scheduler = self.engine.scheduler
        for parent, children in sorted(forks.items(), key=lambda item: bool(item[1])):
            scheduler.fork(parent, children)

    def consume(
        self, outputs: list[EngineCoreOutput], runner_output: ModelRunnerOutput
    ) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        """Take the beams' outputs out of a step's (their candidates: the runner's, by the
        request that carries each group); returns the others, and the searches that finished
        (their final outputs)."""
        if not self.searches:
            return outputs, []
        candidates = runner_output.beam_candidates
        rest: list[EngineCoreOutput] = []
        finished: list[RequestOutput] = []
        for out in outputs:
            search_id = self._child_to_search.get(out.req_id)
            if search_id is None:
                rest.append(out)
                continue
            if out.finish_reason is None:
                continue  # (a beam's request ends with its one token: not reached)
            del self._child_to_search[out.req_id]
            state = self.searches[search_id]
            found = candidates.get(out.req_id)
            if found is not None:
                state.candidates += zip(found.scores, found.beams, found.token_ids)
            state.num_back += 1
            if state.num_back == len(state.children):
                if state.advance():
                    finished.append(self._finish(state))
                else:
                    self._issue(state)
        return rest, finished

    def _finish(self, state: BeamSearchState) -> RequestOutput:
        del self.searches[state.req_id]
        del self._child_params[state.req_id]
        for child_id in state.children:  # the last step's beams: their KV goes back
            self.engine.scheduler.release(child_id)
        tokenizer = self.engine.tokenizer
        outputs = []
        for index, (_, _, tokens, cumulative) in enumerate(state.finished[: state.params.n]):
            text = ""
            if tokenizer is not None:
                text = tokenizer.decode(
                    tokens, skip_special_tokens=state.params.skip_special_tokens
                )
            ended_by_eos = bool(tokens) and tokens[-1] in state.eos_token_ids
            outputs.append(
                CompletionOutput(
                    index,
                    text,
                    list(tokens),
                    None,
                    "stop" if ended_by_eos else "length",
                    tokens[-1] if ended_by_eos else None,
                    cumulative_logprob=cumulative,
                )
            )
        result = RequestOutput(
            state.req_id, state.prompt, state.prompt_token_ids, outputs, finished=True
        )
        self._done[state.req_id] = result
        return result

    def finished_output(self, req_id: str) -> RequestOutput | None:
        return self._done.pop(req_id, None)

    def owns(self, req_id: str) -> bool:
        return req_id in self.searches or req_id in self._done

    def abort(self, req_id: str, child_ids: list[str]) -> RequestOutput | None:
        """Abort a search: its step's beams go, queued, running or finished (their kept KV)."""
        self._done.pop(req_id, None)
        state = self.searches.pop(req_id, None)
        if state is None:
            return None
        del self._child_params[req_id]
        children = list(state.children)
        for child_id in children:
            self._child_to_search.pop(child_id, None)
        self.engine.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
        outputs = [CompletionOutput(0, "", [], None, "abort")]
        return RequestOutput(req_id, state.prompt, state.prompt_token_ids, outputs, True)
