"""Per-request grammar matchers and each step's allowed-token bitmask, advanced and filled off
the runner's thread.

The runner's thread owns the table of matchers: it adds and removes them and starts a step's fill
(start_fill) when it defers the step's sampler. The fill needs every older step's tokens. Those
the runner has collected it queues (accept_tokens); those still on their way it hands to the fill
as IncomingTokens (the step's host buffer and the CUDA event of its copy), and the worker waits
for them itself: it wakes when the ids land (event.synchronize releases the GIL), reads the
grammar rows' ids from the host buffer, applies the queued and landed tokens and fills the mask,
whatever the runner's thread is doing meanwhile (collecting, the engine's output processing,
scheduling, preparing the next step). finish_fill waits for it just before the sampler needs it.
Between the two calls the runner's thread leaves the matchers alone, and it does not queue the
handed steps' tokens again when it collects them.

Why the worker makes exactly two calls into xgrammar a step: each call releases the GIL (tvm-ffi
does, by default) and must take it back when it returns, and while the runner's thread runs
Python that takes up to the switch interval. So the worker never calls xgrammar per row (no
is_terminated, no per-element read of a result array, which is an FFI call an element): it
makes one batched accept and one batched fill (over `fill_threads` of xgrammar's C++ threads,
which never need the GIL). Which grammars have ended is tracked here, not asked: a matcher
terminates only by accepting a stop token.

Rows in identical grammar states could share one fill, but xgrammar 0.2.9 exposes no key of a
matcher's state to find them by. Its private `_debug_print_internal_state` prints only the last
step's Earley states, whose `rule_start_pos` points back into a history it does not print (what
may follow a closing quote depends on it, and a token can span the quote), and costs an FFI
call (a GIL round trip) a row; the accepted token sequences are no honest stand-in either (two
texts can reach one state). So every live row is filled.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kiln.envs import envs
from kiln.sampling_params import GuidedDecodingParams
from kiln.structured_output.compiler import GrammarCompilerCache

logger = logging.getLogger("kiln")

MAX_FILL_THREADS = 8  # 64 rows of ~0.01-0.4 ms each: more threads mostly start and join
# A thread waiting for the GIL gets it after at most this long (Python's default is 5 ms): the
# worker takes it three times a step (to wake, after its accept, after its fill) while the
# runner's thread runs Python. Only a thread that waits for the GIL forces a switch, so a
# short interval costs little beyond those waits.
GIL_SWITCH_INTERVAL_S = 0.0001


def default_fill_threads() -> int:
    """KILN_GRAMMAR_FILL_THREADS, else half the CPUs this process may run on (the other half
    runs the engine loop, the tokenizer and CUDA's own threads), at most MAX_FILL_THREADS."""
    if envs().grammar_fill_threads > 0:
        return envs().grammar_fill_threads
    if hasattr(os, "sched_getaffinity"):
        usable = len(os.sched_getaffinity(0))
    else:
        usable = os.cpu_count() or 1
    return max(1, min(MAX_FILL_THREADS, usable // 2))


@dataclass
class GrammarStats:
    """Host seconds spent on masks, summed over fills (benchmarks read them)."""

    num_fills: int = 0
    num_rows_filled: int = 0
    # Fills that took a step's ids from its host copy themselves (IncomingTokens), rather than
    # from the runner's thread once it collected the step: the asynchronous schedule's usual case.
    num_early_fills: int = 0
    start_s: float = 0.0  # the runner's thread queuing tokens and starting fills
    # The worker waiting for incoming ids to land, from when it was free to (it ran and the
    # fill was started): hidden under the device's work. Includes taking the GIL back after the
    # event's wait returns, which cannot be told apart from the landing in Python.
    ids_wait_s: float = 0.0
    # From the mask's inputs being there (the incoming ids landed; or start_fill, where every
    # token was queued already) until the worker applies them: its wake-up and the GIL.
    start_delay_s: float = 0.0
    accept_s: float = 0.0  # the worker applying the step's tokens (one batched call)
    fill_s: float = 0.0  # the worker filling the mask (one batched call)
    # From the mask's inputs being there until finish_fill is called: what the work hides under.
    window_s: float = 0.0
    wait_s: float = 0.0  # the runner's thread blocked on a mask it needed: the critical path


@dataclass(eq=False)
class IncomingTokens:
    """A submitted step's sampled ids on their way to the host, for a fill to take there: `ids`
    is its [rows] buffer (pinned on a GPU; on the CPU the ids themselves, already computed),
    `ready` the CUDA event recorded after their copy (None: there already), `req_ids` the
    request of each row. The buffer must not be written again before the fill is finished."""

    ids: torch.Tensor
    ready: Any | None
    req_ids: list[str]


@dataclass(eq=False)
class PendingBitmask:
    """A mask being filled: `host` is its [rows, ceil(V/32)] int32 buffer (pinned on a GPU)."""

    host: torch.Tensor
    done: Future  # -> bool: whether any row was filled (False: every grammar had ended)
    started: float = 0.0  # perf_counter at start_fill
    inputs_at: float = 0.0  # perf_counter once its tokens were there (set by the worker)


@dataclass(eq=False)
class _Row:
    """A request's matcher and whether its grammar has ended (it accepted a stop token)."""

    matcher: Any
    stop_token_ids: frozenset[int]
    ended: bool = False


class GrammarBatch:
    """The runner's matchers, keyed by request id. A request rebuilt after preemption is added
    again with its output so far, which the new matcher replays."""

    def __init__(self, compiler: GrammarCompilerCache, fill_threads: int | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.compiler = compiler
        self.rows: dict[str, _Row] = {}
        self.fill_threads = fill_threads or default_fill_threads()
        self.stats = GrammarStats()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
        self._filler = xgr.BatchGrammarMatcher(self.fill_threads)  # 1: fills in the caller
        self._batch_accept = _batch_accept_function(xgr)
        # The matchers' stop tokens (the model's EOS ids): every matcher here has the same.
        self._stop_token_ids = frozenset(compiler.info.stop_token_ids)
        self._queued: list[tuple[_Row, int]] = []  # tokens the next fill applies first
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._slot = 0
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

    @property
    def matchers(self) -> dict[str, Any]:
        """Request id -> its xgrammar matcher (tokens queued since the last fill not yet in)."""
        return {req_id: row.matcher for req_id, row in self.rows.items()}

    # ---- the runner's thread --------------------------------------------------------------

    def add(self, req_id: str, spec: GuidedDecodingParams, output_token_ids: list[int]) -> None:
        matcher = self._xgr.GrammarMatcher(self.compiler.compile(spec))
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                break
        self.rows[req_id] = _Row(matcher, self._stop_token_ids, matcher.is_terminated())

    def remove(self, req_id: str) -> None:
        self.rows.pop(req_id, None)

    def accept_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Queue the tokens sampled for a step's rows: the next fill's worker applies them
        before it fills."""
        t = time.perf_counter()
        rows = self.rows
        queued = self._queued
        for req_id, token_id in zip(req_ids, token_ids):
            row = rows.get(req_id)
            if row is not None:
                queued.append((row, token_id))
        self.stats.start_s += time.perf_counter() - t

    def has_grammar(self, req_ids: list[str]) -> bool:
        rows = self.rows
        return any(req_id in rows for req_id in req_ids)

    def start_fill(
        self,
        req_ids: list[str],
        device: torch.device,
        incoming: Sequence[IncomingTokens] = (),
    ) -> PendingBitmask:
        """Start filling the mask of a step's sampling rows. Every older step's tokens must be
        queued already or be in `incoming` (oldest first): the worker waits for those to land
        and applies them after the queued ones. Rows without a grammar, or whose grammar has
        ended, allow every token. The rows of incoming tokens are looked up now: a request
        removed or added again later does not change what this fill applies."""
        t = time.perf_counter()
        queued, self._queued = self._queued, []
        rows = self.rows
        live, indices = [], []
        for index, req_id in enumerate(req_ids):
            row = rows.get(req_id)
            if row is not None and not row.ended:
                live.append(row)
                indices.append(index)
        landing = []  # (ids, ready, [(index in the step's ids, row)])
        for step in incoming:
            taken = [(i, row) for i, r in enumerate(step.req_ids) if (row := rows.get(r))]
            landing.append((step.ids, step.ready, taken))
        host = self._buffer(len(req_ids), device)
        pending = PendingBitmask(host, Future(), t, t)
        if live or queued or any(taken for _, _, taken in landing):
            pending.done = self._worker.submit(
                self._work, queued, landing, live, host, indices, pending
            )
            if incoming:
                self.stats.num_early_fills += 1
        else:
            pending.done.set_result(False)
        self.stats.start_s += time.perf_counter() - t
        return pending

    def finish_fill(self, pending: PendingBitmask, device: torch.device) -> torch.Tensor | None:
        """Wait for a mask and start its copy to `device` (None: nothing to apply)."""
        t = time.perf_counter()
        filled = pending.done.result()
        stats = self.stats
        stats.wait_s += time.perf_counter() - t
        stats.window_s += max(0.0, t - pending.inputs_at)
        if not filled:
            return None
        return pending.host.to(device, non_blocking=True)  # pinned: an asynchronous copy

    def fill_bitmask(self, req_ids: list[str], device: torch.device) -> torch.Tensor | None:
        """The synchronous fill: start_fill + finish_fill."""
        return self.finish_fill(self.start_fill(req_ids, device), device)

    def _buffer(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """One of two host buffers, alternating: the step before this one may still be copying
        out of the other. The one returned was copied out two fills ago: that copy has been read
        once the step before this one has sampled, which the worker waits for (its incoming
        ids) before writing, or which was collected already when nothing is incoming."""
        self._slot ^= 1
        buf = self._buffers[self._slot]
        if buf is None or buf.shape[0] < num_rows:
            words = -(-self.compiler.vocab_size // 32)
            pin = device.type == "cuda"
            with torch.inference_mode(False):  # written in place outside it too
                buf = torch.empty((max(num_rows, 64), words), dtype=torch.int32, pin_memory=pin)
            self._buffers[self._slot] = buf
        return buf[:num_rows]

    # ---- the worker -----------------------------------------------------------------------

    def _work(
        self,
        queued: list[tuple[_Row, int]],
        landing: list[tuple[torch.Tensor, Any, list[tuple[int, _Row]]]],
        live: list[_Row],
        host: torch.Tensor,
        indices: list[int],
        pending: PendingBitmask,
    ) -> bool:
        t0 = time.perf_counter()
        ready_at = pending.started  # landed before the worker ran: counted from start_fill
        for ids, ready, taken in landing:
            if ready is not None and not ready.query():
                ready.synchronize()  # releases the GIL while it waits
                ready_at = time.perf_counter()
            if taken:
                values = ids.tolist()
                queued.extend((row, values[i]) for i, row in taken)
        if len(live) < host.shape[0]:
            host.fill_(-1)  # all allowed; xgrammar overwrites the filled rows whole
        t1 = time.perf_counter()
        pending.inputs_at = ready_at
        self._accept(queued)
        t2 = time.perf_counter()
        matchers, filled = [], []
        for row, index in zip(live, indices):
            if row.ended:  # it ended with the token just applied: all allowed from now on
                host[index].fill_(-1)
            else:
                matchers.append(row.matcher)
                filled.append(index)
        if matchers:
            self._filler.batch_fill_next_token_bitmask(matchers, host, filled)
        t3 = time.perf_counter()
        stats = self.stats
        stats.ids_wait_s += max(0.0, ready_at - t0)
        stats.start_delay_s += t1 - ready_at
        stats.accept_s += t2 - t1
        if matchers:
            stats.fill_s += t3 - t2
            stats.num_fills += 1
            stats.num_rows_filled += len(matchers)
        return bool(matchers)

    def _accept(self, queued: list[tuple[_Row, int]]) -> None:
        """Advance matchers by their queued tokens, in order: one batched call a round (a
        matcher queued twice, which the runner does not do, takes a second round)."""
        while queued:
            seen: set[int] = set()
            batch: list[tuple[_Row, int]] = []
            later: list[tuple[_Row, int]] = []
            for item in queued:
                row = item[0]
                if row.ended:
                    continue  # an ended grammar takes nothing more (ignore_eos goes on freely)
                (later if id(row) in seen else batch).append(item)
                seen.add(id(row))
            if batch:
                self._batch_accept([row.matcher for row, _ in batch], [t for _, t in batch])
                for row, token_id in batch:
                    if token_id in row.stop_token_ids:  # the one way a grammar ends
                        row.ended = row.matcher.is_terminated()
            queued = later


def _batch_accept_function(xgr: Any) -> Any:
    """(matchers, tokens) -> None: xgrammar's batched accept. Its public wrapper reads the
    result array back one FFI call an element (each a GIL round trip), and nothing here reads
    the result, so call the binding beneath it (xgrammar 0.2.9's layout) when it is there."""
    core = getattr(getattr(xgr, "matcher", None), "_core", None)
    raw = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if raw is None:
        return xgr.BatchGrammarMatcher.batch_accept_token
    return lambda matchers, tokens: raw([m._handle for m in matchers], tokens, False)
