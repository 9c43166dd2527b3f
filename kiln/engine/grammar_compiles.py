"""Grammar requests wait out of scheduling while their grammar compiles in the background.

A request with `guided_decoding` is validated when added (parsed: a bad schema is a 400 before
queueing), its compile starts on a background thread, and it is held (GrammarWaitlist) until the
compile is done: then queued in the scheduler (which keeps FCFS by arrival time), or ended with
the compile's error. The engine serves the other requests meanwhile.
"""

from __future__ import annotations

from typing import Any

from kiln.engine.hooks import EngineHook
from kiln.engine.request import Request
from kiln.engine.scheduler import EngineCoreOutput, Scheduler
from kiln.errors import InvalidRequestError
from kiln.sampling_params import SamplingParams
from kiln.structured_output.waitlist import GrammarWaitlist

# An engine with only compiling requests waits at most this long per step() for one to finish
# (then returns, so its driver can take in new requests).
GRAMMAR_WAIT_S = 0.01


class GrammarCompiles(EngineHook):
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        world_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.world_size = world_size
        self.waitlist = GrammarWaitlist()

    def _compiler(self) -> Any:  # kiln.structured_output.GrammarCompilerCache
        from kiln.structured_output import compiler_for

        return compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def validate(self, params: SamplingParams) -> None:
        if params.guided_decoding is None:
            return
        # Parse now (cheap; the compile runs in the background): a bad schema or grammar is a
        # 400 before queueing.
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured output needs a tokenizer", param="guided_decoding"
            )
        if self.world_size > 1:  # the ranks' sampler applies no token bitmask yet
            raise InvalidRequestError(
                "structured output is not supported with tensor or pipeline parallelism yet",
                param="guided_decoding",
            )
        self._compiler().validate(params.guided_decoding)

    def hold(self, request: Request) -> bool:
        spec = request.sampling_params.guided_decoding
        if spec is None:
            return False
        # Held even when done: a failed compile must not be scheduled. (The compiler shares one
        # compile between the completions of a request, and caches it for the next.)
        self.waitlist.add(request.req_id, request, self._compiler().compile_async(spec))
        return True

    def release(self) -> list[EngineCoreOutput]:
        """Queue the held requests whose grammar is ready (by arrival time: FCFS keeps their
        place); those whose compile failed end with finish_reason "error"."""
        if not self.waitlist:
            return []
        ready, failed = self.waitlist.take_done()
        for request in ready:
            self.scheduler.add_request(request)
        return [EngineCoreOutput(f.item.req_id, [], "error", error=f.error) for f in failed]

    def wait_for_held(self) -> None:
        if self.waitlist:
            self.waitlist.wait(GRAMMAR_WAIT_S)

    def abort(self, request_id: str, child_ids: list[str]) -> None:
        for child in child_ids:  # held while compiling: nothing allocated, just let go
            self.waitlist.abort(child)
        return None

    def has_work(self) -> bool:
        return bool(self.waitlist)

    def held_req_ids(self) -> set[str]:
        return self.waitlist.req_ids
