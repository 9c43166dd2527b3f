"""Beam search above the scheduler: each step, every running beam is one ordinary request of one
token (its prompt = the request's prompt + the beam's tokens, greedy, with the raw top-K
logprobs), so beams batch with every other request, and share their KV blocks through the prefix
cache and the block pool's reference counts: a beam's full blocks are hits (the prompt's and the
common prefix's), only its last partial block is recomputed. A step's children finish with their
one token, so nothing outlives a step and an abort frees every block.

The selection is Hugging Face's `generate(num_beams=W, do_sample=False, length_penalty,
early_stopping)` step for step (transformers' _beam_search): the top K = max(2, 1 + #EOS) * W
continuations over all beams by cumulative fp32 log-probability; those ending in EOS or at
max_tokens finish, if among the top W, with score logprob / generated_len ** length_penalty;
the best W others run on; the early-stopping heuristic and `early_stopping` True / False /
"never" as HF's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.engine.llm_engine import LLMEngine

NEG = -1.0e9  # HF's "impossible" score


@dataclass
class _Beam:
    tokens: list[int]
    score: torch.Tensor  # fp32 scalar: cumulative log-probability (HF's arithmetic)


@dataclass
class BeamSearchState:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int
    width: int
    running: list[_Beam] = field(default_factory=list)
    finished: list[tuple[torch.Tensor, bool, list[int], torch.Tensor]] = field(default_factory=list)
    """W slots of (penalized score, is finished, tokens, cumulative logprob), best first."""
    unsatisfied: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    step: int = 0
    children: dict[str, int] = field(default_factory=dict)  # child id -> running beam index
    results: dict[int, dict] = field(default_factory=dict)  # beam index -> top-K {token: lp}
    output: RequestOutput | None = None

    @property
    def keep(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def __post_init__(self) -> None:
        zero = torch.zeros((), dtype=torch.float32)
        # Beams 1.. start at -1e9, so the first step expands beam 0 alone (as HF).
        self.running = [_Beam([], zero if i == 0 else zero + NEG) for i in range(self.width)]
        self.finished = [(zero + NEG, False, [], zero + NEG) for _ in range(self.width)]

    def advance(self) -> bool:
        """One HF step from the children's top-K logprobs; True when the search is over."""
        W, K = self.width, self.keep
        generated = self.step + 1  # tokens each candidate has (cur_len + 1 - prompt_len)
        candidates = []  # (accumulated fp32, beam index, token)
        for b, beam in enumerate(self.running):
            for token, logprob in self.results.get(b, {}).items():
                acc = torch.tensor(logprob, dtype=torch.float32) + beam.score
                candidates.append((acc, b, token))
        candidates.sort(key=lambda c: (-c[0].item(), c[1], c[2]))
        top = candidates[:K]
        hits = [t in self.eos_token_ids or generated >= self.max_tokens for _, _, t in top]
        # Running beams for the next step: the best W that did not just finish.
        alive = sorted(
            range(len(top)), key=lambda i: (-(top[i][0] + (NEG if hits[i] else 0.0)).item(), i)
        )[:W]
        new_running = [
            _Beam(
                [*self.running[top[i][1]].tokens, top[i][2]], top[i][0] + (NEG if hits[i] else 0.0)
            )
            for i in alive
        ]
        # Finished hypotheses: the top-W candidates that hit a stop, length-penalized.
        all_finished = all(f[1] for f in self.finished)
        lp = self.params.length_penalty
        merged = list(self.finished)
        for i, (acc, b, token) in enumerate(top):
            done = hits[i] and i < W
            score = acc / (generated**lp)
            if all_finished and self.params.early_stopping is True:
                score = score + NEG
            if not self.unsatisfied:
                score = score + NEG
            if not done:
                score = score + NEG
            merged.append((score, done, [*self.running[b].tokens, token], acc))
        order = sorted(range(len(merged)), key=lambda i: (-merged[i][0].item(), i))[:W]
        self.finished = [merged[i] for i in order]
        self.running = new_running
        self.step += 1
        # HF's early-stopping heuristic, then its loop condition.
        if self.params.early_stopping == "never" and lp > 0.0:
            best_len = self.max_tokens
        else:
            best_len = self.step
        best_running = self.running[0].score / (best_len**lp)
        worst = min(f[0] for f in self.finished).item()
        worst_finished = [worst if f[1] else NEG for f in self.finished]
        self.unsatisfied = self.unsatisfied and any(best_running.item() > w for w in worst_finished)
        open_beam = not (all(f[1] for f in self.finished) and self.params.early_stopping is True)
        return not (self.unsatisfied and open_beam and not all(hits))


class BeamSearchManager:
    """The engine's beam searches: issues each step's children, routes their outputs back."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.searches: dict[str, BeamSearchState] = {}
        self._child_to_parent: dict[str, str] = {}
        self._done: dict[str, RequestOutput] = {}

    @property
    def active(self) -> bool:
        return bool(self.searches)

    def add(
        self,
        req_id: str,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
    ) -> str:
        width = params.best_of or params.n
        state = BeamSearchState(
            req_id, prompt, token_ids, params, self.engine.eos_token_ids, max_tokens, width
        )
        self.searches[req_id] = state
        self._issue(state)
        return req_id

    def _issue(self, state: BeamSearchState) -> None:
        child_params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            logprobs=state.keep,
            ignore_eos=True,
            skip_special_tokens=state.params.skip_special_tokens,
        )
        state.children, state.results = {}, {}
        # The first step expands beam 0 alone: the others are the same prompt at -1e9.
        beams = [0] if state.step == 0 else range(len(state.running))
        for b in beams:
            child_id = f"{state.req_id}#beam{state.step}.{b}"
            tokens = state.prompt_token_ids + state.running[b].tokens
            state.children[child_id] = b
            self._child_to_parent[child_id] = state.req_id
            self.engine.add_request(tokens, child_params, request_id=child_id)

    def route(self, deltas: list[RequestOutput]) -> list[RequestOutput]:
        """Consume the children's outputs; returns the other deltas plus finished searches."""
        out = []
        for delta in deltas:
            parent = self._child_to_parent.get(delta.request_id)
            if parent is None:
                out.append(delta)
                continue
            if not delta.finished:
                continue
            final = self.engine.finished_output(delta.request_id)
            self._child_to_parent.pop(delta.request_id)
            state = self.searches[parent]
            position = final.outputs[0].logprobs[0]
            state.results[state.children[delta.request_id]] = {
                t: lp.logprob for t, lp in position.items()
            }
            if len(state.results) == len(state.children):
                if state.advance():
                    out.append(self._finish(state))
                else:
                    self._issue(state)
        return out

    def _finish(self, state: BeamSearchState) -> RequestOutput:
        del self.searches[state.req_id]
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
                    cumulative_logprob=cumulative.item(),
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

    def abort(self, req_id: str) -> RequestOutput | None:
        """Abort a search: its step's children (the only requests holding its blocks) go."""
        self._done.pop(req_id, None)
        state = self.searches.pop(req_id, None)
        if state is None:
            return None
        children = [c for c in state.children if c in self._child_to_parent]
        for child in children:
            self._child_to_parent.pop(child)
        if children:
            self.engine.abort_request(children)
        outputs = [CompletionOutput(0, "", [], None, "abort")]
        return RequestOutput(req_id, state.prompt, state.prompt_token_ids, outputs, True)
