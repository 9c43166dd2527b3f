"""Features beside the scheduler: the one interface the engine calls them through.

Beam search (beam_search.py) serves a request itself, as one-token requests of its beams; grammar
compiles (grammar_compiles.py) hold a request out of scheduling until its grammar is ready. The
engine knows neither: it calls each EngineHook at fixed points of its life, in order:

    add_request   validate, then `add_request` (a hook may serve the whole request), then for
                  each request the scheduler would queue, `hold` (a hook may keep it out for now)
    step()        `release` (the held requests that may go on; failures end as outputs),
                  `wait_for_held` (only when the engine has nothing else to do), then the step
                  loop; each collected step's outputs go through `consume` (a hook takes its
                  own, before the next schedule) and the rest to the output processor
    abort_request `abort`
    queries       `owns`, `has_work`, `held_req_ids`, `finished_output`

Every method here does nothing (the defaults say "not mine"), so a hook overrides only its
points, and each returns at once when it holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.engine.request import Request
from kiln.engine.scheduler import EngineCoreOutput
from kiln.interfaces import ModelRunnerOutput
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """A validated request as the engine received it."""

    request_id: str
    prompt: str | None  # the text, if it came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # max_tokens, capped by the context left after the prompt
    priority: int


class EngineHook:
    def validate(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError for params this hook cannot serve."""

    def owns(self, request_id: str) -> bool:
        """The id is in use by a request this hook serves (or holds a final output of)."""
        return False

    def add_request(self, new: NewRequest) -> bool:
        """True: this hook serves the whole request (nothing else sees it)."""
        return False

    def hold(self, request: Request) -> bool:
        """True: keep this request out of the scheduler until `release` queues it."""
        return False

    def release(self) -> list[EngineCoreOutput]:
        """Queue the held requests that may go on in the scheduler; return outputs that end
        those that cannot (finish_reason "error")."""
        return []

    def wait_for_held(self) -> None:
        """The engine has nothing to run: block briefly until a held request may go on."""

    def consume(
        self, outputs: list[EngineCoreOutput], runner_output: ModelRunnerOutput
    ) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        """Take this hook's outputs out of a collected step's, before the next schedule;
        returns the others, and final outputs of requests this hook finished."""
        return outputs, []

    def abort(self, request_id: str, child_ids: list[str]) -> RequestOutput | None:
        """Abort a request (`child_ids`: its completions' scheduler ids); its final output if
        this hook served it."""
        return None

    def has_work(self) -> bool:
        """Requests this hook serves or holds are unfinished."""
        return False

    def held_req_ids(self) -> set[str]:
        """The scheduler ids this hook holds out of scheduling."""
        return set()

    def finished_output(self, request_id: str) -> RequestOutput | None:
        """Pop the final output of a request this hook served."""
        return None
