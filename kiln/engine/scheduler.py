"""Token-budget scheduler: decodes and prefill chunks share each step.

schedule() -> SchedulerOutput hands out `{req_id: num_tokens}` within `max_num_batched_tokens`
and advances each request's `num_computed_tokens` right away; a request whose tokens reach its end
will sample, and holds an output placeholder until update(SchedulerOutput, ModelRunnerOutput)
brings the token, applies stop rules and frees finished requests.

Because schedule() does not wait for update(), the engine may schedule step N+1 while step N still
runs (async scheduling): a decode then computes its placeholder token, whose id the runner takes
from step N's sampled ids on the device. A request that finishes in step N may already be in step
N+1: its extra token is dropped by update(), which only applies tokens to live requests. Pure
Python: no torch, so it is unit-tested with fake runner outputs, in both orders.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.engine.occupancy import Occupancy
from kiln.engine.request import Request, RequestStatus
from kiln.interfaces import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobsChunk,
    SchedulerOutput,
    TokenLogprobs,
)
from kiln.kv_cache.hybrid import HybridKVCacheManager
from kiln.kv_cache.manager import KVCacheManager
from kiln.lora.slots import LoRASlots


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request. Not frozen, though never changed: one is made
    per running request a step, and a frozen dataclass's __init__ (object.__setattr__ per
    field) costs 0.9 us against 0.16 us, ~0.4 ms of a 512-request step."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: PromptLogprobsChunk | None = None
    num_cached_tokens: int = 0
    # Speculative decoding, this step: drafts verified and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None  # finish_reason "error": why (a grammar's compile failed)


@dataclass
class SpecDecodeStats:
    """Totals since start (Prometheus counters, vLLM's spec_decode_* names)."""

    num_drafts: int = 0  # verification steps of a request
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at i


@dataclass
class _StepPlan:
    """One step's schedule while schedule() builds it."""

    budget: int  # tokens still to hand out
    max_requests: int = 1 << 62  # requests this step may take (pipeline micro-batches: a share)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # num_scheduled's order
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_preempted: int = 0
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled[request.req_id] = num_tokens
        self.scheduled.append((request, num_tokens))
        self.budget -= num_tokens


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager | HybridKVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        num_spec_tokens: Callable[[int], int] | None = None,
        num_micro_batches: int = 1,
        lora_slots: LoRASlots | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        # LoRA: the device's adapter slots. A request runs only while its adapter holds one,
        # so a step uses at most max_loras adapters; one whose adapter finds no slot waits.
        self.lora_slots = lora_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        # Speculative decoding: how many drafts a decode may verify, given the running batch's
        # size (kiln.spec_decode's policy); None: no speculation.
        self.num_spec_tokens = num_spec_tokens
        # Pipeline micro-batches (> 1: that many steps in flight): a request whose sampled token
        # is in flight waits for it instead of being scheduled ahead on a placeholder, so the
        # steps in flight hold different requests and no stage needs another step's sampled ids
        # for its inputs; and a step takes at most its share of the requests, so that one step
        # taking them all does not leave the next one (and a pipeline stage) empty.
        self.num_micro_batches = num_micro_batches
        self.spec_stats = SpecDecodeStats()
        self.requests: dict[str, Request] = {}
        # Both kept sorted by `_key`: the front is served first, the back preempted first.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Forked requests (fork()): they continue a running sequence and hold every block they
        # need, so they are admitted before the waiting queue, whatever the pool holds.
        self.forked: list[Request] = []
        self._finished_req_ids: set[str] = set()
        # Finished requests whose KV is kept (Request.retain_kv) until fork() hands it on.
        self.retained: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.occupancy = Occupancy()  # the most sequences run at once (kiln bench reports it)
        self._step_ids = itertools.count(1)
        # The Request objects each scheduled step ran, until update() has applied its output.
        self._scheduled: dict[int, dict[str, Request]] = {}

    def _key(self, request: Request) -> tuple[int, float]:
        if self.policy == "priority":
            return request.sort_key()
        return (0, request.arrival_time)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id!r} is already in use")
        self.requests[request.req_id] = request
        bisect.insort(self.waiting, request, key=self._key)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[Request]:
        """Abort (or stop) requests wherever they are; their blocks are freed at once (those a
        finished request retained too)."""
        finished = []
        for req_id in req_ids:
            retained = self.retained.pop(req_id, None)
            if retained is not None:
                self.kv_cache.free(retained)
                continue
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self._stop_running(request)
            elif request in self.forked:
                self.forked.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)
            finished.append(request)
        return finished

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request.retain_kv and status != RequestStatus.FINISHED_ABORTED:
            self.retained[request.req_id] = request
        else:
            self.kv_cache.free(request)
        self._finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]

    def release(self, req_id: str) -> None:
        """Let go of the KV a finished request retained (Request.retain_kv)."""
        self.kv_cache.free(self.retained.pop(req_id))

    def _reclaim_retained(self) -> bool:
        """The pool is short: drop the KV that finished requests retained (a fork from them then
        falls back to a recompute) before anyone waits or is preempted for it. Retained KV waits
        on its owner (a beam step's other requests), which may itself wait for blocks: held
        through that, it could stall every request. Returns whether any blocks were let go."""
        reclaimed = False
        for request in self.retained.values():
            if request.num_computed_tokens:
                self.kv_cache.free(request)
                request.num_computed_tokens = 0
                reclaimed = True
        return reclaimed

    def fork(self, parent_id: str, children: list[Request]) -> bool:
        """Queue `children`, each continuing the retained request `parent_id`: its tokens up to
        the parent's computed ones are the parent's, then at least one more. Their KV up to there
        is the parent's, forked copy-on-write (KVCacheManager.fork), so each computes only its new
        tokens (one, for a beam: a plain decode row); they hold every block they need and are
        admitted before the waiting queue. When the pool cannot hold their blocks, or the parent
        lost its KV (preempted while its last token was in flight, or reclaimed), they queue as
        fresh requests (prefix-cache hits, then a recompute). The parent's KV is let go either
        way. Returns whether they were forked."""
        parent = self.retained.pop(parent_id)
        num_computed = parent.num_computed_tokens
        for child in children:
            if child.num_tokens <= num_computed or (
                child.all_token_ids[:num_computed] != parent.all_token_ids[:num_computed]
            ):
                raise ValueError(f"{child.req_id!r} does not continue {parent_id!r}")
        forked = bool(children) and self.kv_cache.fork(parent, children)
        self.kv_cache.free(parent)  # (the children's own references keep what they share)
        for child in children:
            if not forked:
                self.add_request(child)
                continue
            if child.req_id in self.requests:
                raise ValueError(f"request id {child.req_id!r} is already in use")
            child.num_computed_tokens = num_computed
            self.requests[child.req_id] = child
            bisect.insort(self.forked, child, key=self._key)
        return forked

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.forked)

    # ---- one step ------------------------------------------------------------------------

    def _stop_running(self, request: Request) -> None:
        """Take a request out of the running list (finished or preempted): its adapter's slot
        may go to another adapter once no running request uses it."""
        self.running.remove(request)
        if request.lora_int_id is not None and self.lora_slots is not None:
            self.lora_slots.release(request.lora_int_id)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self._stop_running(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._finished_req_ids.add(request.req_id)
        bisect.insort(self.waiting, request, key=self._key)

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        if self.num_micro_batches > 1:  # this step's share of the requests that may run
            num_live = min(len(self.running) + len(self.waiting), self.max_num_seqs)
            plan.max_requests = max(1, -(-num_live // self.num_micro_batches))
        self._schedule_running(plan)
        self._admit_forked(plan)
        # Not in a step that had to preempt: admitting would only evict someone again.
        if not plan.num_preempted:
            self._admit_waiting(plan)

        # The step's tokens count as computed from now on; a request whose tokens reach its end
        # samples, and holds a placeholder until update() brings the token.
        scheduled: dict[str, Request] = {}
        spec_tokens = plan.spec_tokens
        num_sampling = 0  # requests whose every token is in the cache this step
        for request, num_new in plan.scheduled:
            request.num_computed_tokens += num_new
            num_drafts = len(spec_tokens.get(request.req_id, ())) if spec_tokens else 0
            # (num_tokens_with_placeholders, inlined: this loop runs once per running request)
            placeholders = request.num_output_placeholders
            num_to_sample = len(request.all_token_ids) + placeholders + num_drafts
            if request.num_computed_tokens == num_to_sample:
                request.num_output_placeholders = placeholders + 1
                num_sampling += 1
            scheduled[request.req_id] = request
        self.occupancy.record(num_sampling, len(self.running), self.kv_cache.pool.num_used_blocks)

        finished, self._finished_req_ids = self._finished_req_ids, set()
        step_id = next(self._step_ids)
        block_copies = self.kv_cache.take_block_copies()
        if scheduled:
            self._scheduled[step_id] = scheduled
        return SchedulerOutput(
            new_requests=plan.new_requests,
            cached_requests=plan.cached_requests,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=frozenset(finished),
            num_preempted=plan.num_preempted,
            step_id=step_id,
            scheduled_spec_decode_tokens=plan.spec_tokens,
            block_copies=block_copies,
            beam_rows={r: q.beam for r, q in scheduled.items() if q.beam is not None},
            lora_loads=self.lora_slots.take_loads() if self.lora_slots is not None else [],
        )

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Running requests first, in priority order: every decode, then unfinished prefill
        chunks with the budget the decodes left, so that a long prompt (or a recompute after
        preemption) never takes a step's whole budget from requests that are generating. When
        the pool is full, the lowest-priority running request not yet scheduled is preempted to
        make room.
        One pass a running request a step: the per-request work is kept to plain attribute reads
        (hundreds of decodes a step make each call and property here cost a visible share of
        the host's step)."""
        deferred: list[Request] = []
        for request in list(self.running):
            if plan.budget <= 0:
                return
            if request.status != RequestStatus.RUNNING:
                continue  # preempted this step to make room for an earlier one
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + placeholders  # with placeholders
            if num_tokens - request.num_computed_tokens > 1:
                deferred.append(request)  # a prefill chunk: after the decodes
                continue
            if not self._schedule_one(request, num_tokens, placeholders, plan):
                return
        for request in deferred:
            if plan.budget <= 0 or request.status != RequestStatus.RUNNING:
                continue
            placeholders = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + placeholders
            if not self._schedule_one(request, num_tokens, placeholders, plan):
                return

    def _schedule_one(
        self, request: Request, num_tokens: int, placeholders: int, plan: _StepPlan
    ) -> bool:
        """Schedules a running request's next tokens (or skips it: its token is in flight).
        Returns False when nothing more can be scheduled this step."""
        if placeholders and (
            self.num_micro_batches > 1
            # Or its remaining tokens are all scheduled already: the last one it may sample
            # (by max_tokens or the context length) is in flight, awaiting update().
            or len(request.output_token_ids) + placeholders >= request.max_tokens
            or num_tokens >= self.max_model_len
        ):
            return True  # its (last) token is in flight: nothing to compute before it is back
        if len(plan.num_scheduled) >= plan.max_requests:
            return False
        num_new = min(num_tokens - request.num_computed_tokens, plan.budget)
        drafts = None
        if request.spec_token_ids:
            drafts = self._drafts_to_verify(request, plan.budget)
            num_new += len(drafts)
        allocate_slots = self.kv_cache.allocate_slots
        new_blocks = allocate_slots(request, num_new)
        if new_blocks is None and self._reclaim_retained():
            new_blocks = allocate_slots(request, num_new)
        while new_blocks is None:
            victim = self._preemption_victim(plan)
            if victim is None:
                return False
            self._preempt(victim)
            plan.num_preempted += 1
            if victim is request:
                return False  # it was the last that could go: the pool is full
            new_blocks = allocate_slots(request, num_new)
        plan.add(request, num_new)
        if drafts:
            plan.spec_tokens[request.req_id] = drafts
        plan.cached_requests.append(
            CachedRequestData(
                request.req_id,
                [b.block_id for b in new_blocks] if new_blocks else [],
                request.num_computed_tokens,
            )
        )
        return True

    def _preemption_victim(self, plan: _StepPlan) -> Request | None:
        """The lowest-priority running request this step has not scheduled (decodes go first,
        so a scheduled one may sit behind an unscheduled prefill)."""
        for request in reversed(self.running):
            if request.req_id not in plan.num_scheduled:
                return request
        return None

    def _admit_forked(self, plan: _StepPlan) -> None:
        """Admit forked requests while budget and sequence slots allow: their KV up to their
        computed tokens is the parent's, and their blocks are all theirs already (fork())."""
        while self.forked and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.forked[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            if self.kv_cache.allocate_slots(request, num_new) is None:
                break  # (not reached: a fork reserves every block its request needs)
            self.forked.pop(0)
            self._start(request, num_new, plan)

    def _admit_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests, prefix hits first, while budget, sequence slots and blocks
        allow. A request whose LoRA adapter finds no free slot is passed over (those behind it
        may run: their adapters are resident, or they have none)."""
        index = 0
        slots = self.lora_slots
        while (
            index < len(self.waiting)
            and plan.budget > 0
            and len(self.running) < self.max_num_seqs
            and len(plan.num_scheduled) < plan.max_requests
        ):
            request = self.waiting[index]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: resent in full once it is back
            lora = request.lora_int_id
            if lora is not None and slots is not None and not slots.can_acquire(lora):
                index += 1
                continue
            hit_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, plan.budget)
            if self.kv_cache.allocate_slots(request, num_new, hit_blocks) is None:
                if self._reclaim_retained():
                    continue  # (its prefix hits looked up again)
                break
            self.waiting.pop(index)
            if request.num_preemptions == 0:
                self.kv_cache.record_admission(request, num_hit_tokens)
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            self._start(request, num_new, plan)

    def _start(self, request: Request, num_new: int, plan: _StepPlan) -> None:
        """An admitted request runs from this step, its blocks allocated: sent in full."""
        request.status = RequestStatus.RUNNING
        if request.lora_int_id is not None and self.lora_slots is not None:
            self.lora_slots.acquire(request.lora_int_id)
        bisect.insort(self.running, request, key=self._key)
        plan.add(request, num_new)
        plan.new_requests.append(
            NewRequestData(
                req_id=request.req_id,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv_cache.block_ids(request.req_id),
                num_computed_tokens=request.num_computed_tokens,
                lora_int_id=request.lora_int_id,
            )
        )

    def _drafts_to_verify(self, request: Request, budget: int) -> list[int]:
        """The drafts a decode verifies this step: as many as the policy allows for this batch
        size, the budget holds, and neither max_tokens nor the context is passed by accepting
        them all plus the bonus token."""
        if (
            not request.spec_token_ids
            or self.num_spec_tokens is None
            or request.num_output_placeholders
            or request.num_tokens - request.num_computed_tokens != 1
        ):
            return []
        k = min(
            len(request.spec_token_ids),
            self.num_spec_tokens(len(self.running)),
            budget - 1,
            self.max_model_len - request.num_tokens,
            request.max_tokens - request.num_output_tokens - 1,
        )
        return request.spec_token_ids[: max(k, 0)]

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append each request's sampled tokens in order, checking the stop rules after every
        one (a token past a stop is dropped), and free the requests that finished."""
        outputs: list[EngineCoreOutput] = []
        scheduled = self._scheduled.pop(scheduler_output.step_id, {})
        # Once per running request a step: the output's dicts are looked into only when not
        # empty (most steps have no logprobs, prompt logprobs or drafts).
        requests = self.requests
        all_sampled = runner_output.sampled_token_ids
        all_prompt_logprobs = runner_output.prompt_logprobs
        all_logprobs = runner_output.logprobs
        all_drafts = scheduler_output.scheduled_spec_decode_tokens
        next_drafts = runner_output.spec_token_ids
        for req_id, request in scheduled.items():
            if request.is_finished or requests.get(req_id) is not request:
                continue  # finished, or aborted, while the step ran: its tokens are dropped
            prompt_logprobs = all_prompt_logprobs.get(req_id) if all_prompt_logprobs else None
            token_ids = all_sampled.get(req_id)
            if not token_ids:
                if prompt_logprobs:
                    outputs.append(EngineCoreOutput(req_id, [], prompt_logprobs=prompt_logprobs))
                continue
            request.num_output_placeholders -= 1  # the step held one placeholder
            num_drafts = len(all_drafts.get(req_id, ())) if all_drafts else 0
            if num_drafts:
                self._apply_verification(request, num_drafts, len(token_ids))
            new_token_ids, finish = self._append_until_stop(request, token_ids)
            if finish is not None:
                if request.status == RequestStatus.RUNNING:
                    self._stop_running(request)
                else:  # preempted while its token was in flight
                    self.waiting.remove(request)
                self._free(request, finish)
            logprobs = all_logprobs.get(req_id) if all_logprobs else None
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    finish.value if finish else None,
                    request.stop_reason,
                    logprobs[: len(new_token_ids)] if logprobs else None,
                    prompt_logprobs,
                    request.num_cached_tokens,
                    num_drafts,
                    len(token_ids) - 1 if num_drafts else 0,
                )
            )
            if finish is None and (next_drafts or request.spec_token_ids):
                request.spec_token_ids = next_drafts.get(req_id, [])
        return outputs

    def _apply_verification(self, request: Request, num_drafts: int, num_tokens: int) -> None:
        """A step verified `num_drafts` drafts and gave back `num_tokens` (the accepted ones and
        a bonus): the rejected positions were computed for nothing, so they count as not computed
        and the blocks only they used go back to the pool."""
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_tokens - 1
        request.num_spec_steps += 1
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_tokens - 1
        stats.accepted_per_pos.extend([0] * (num_drafts - len(stats.accepted_per_pos)))
        for pos in range(num_tokens - 1):
            stats.accepted_per_pos[pos] += 1
        request.spec_token_ids = []
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= num_drafts + 1 - num_tokens
            self.kv_cache.free_excess_slots(request)

    def _append_until_stop(
        self, request: Request, token_ids: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        if len(token_ids) == 1:  # a decode's one token (every step but verifications)
            token_id = token_ids[0]
            request.output_token_ids.append(token_id)  # (append_output_token, inlined)
            request.all_token_ids.append(token_id)
            return token_ids, self._check_stop(request, token_id)
        for count, token_id in enumerate(token_ids, 1):
            request.append_output_token(token_id)
            finish = self._check_stop(request, token_id)
            if finish is not None:
                return token_ids[:count], finish
        return token_ids, None

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output_tokens = len(request.output_token_ids)
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
