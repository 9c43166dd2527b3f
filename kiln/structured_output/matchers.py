"""Per-request grammar matchers and each step's allowed-token bitmask, advanced and filled off
the runner's thread.

The runner's thread owns the table of matchers: it adds and removes them, queues each step's
sampled tokens (accept_tokens) and starts a step's fill (start_fill) once every older step's
tokens are queued. A worker thread then applies the queued tokens and fills the mask while the
runner's thread goes on with the step loop (collecting, scheduling, preparing the next step);
finish_fill waits for it just before the sampler needs it. Between the two calls the runner's
thread leaves the matchers alone.

Why the worker makes exactly two calls into xgrammar a step: each call releases the GIL (tvm-ffi
does, by default) and must take it back when it returns, and while the runner's thread runs
Python that takes up to the switch interval. So the worker never calls xgrammar per row (no
is_terminated, no per-element read of a result array, which is an FFI call an element): it
makes one batched accept and one batched fill (over `fill_threads` of xgrammar's C++ threads,
which never need the GIL). Which grammars have ended is tracked here, not asked: a matcher
terminates only by accepting a stop token.
"""

from __future__ import annotations

import logging
import os
import sys
import time
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
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count())
    return max(1, min(MAX_FILL_THREADS, len(usable) // 2))


@dataclass
class GrammarStats:
    """Host seconds spent on masks, summed over fills (benchmarks read them)."""

    num_fills: int = 0
    num_rows_filled: int = 0
    start_s: float = 0.0  # the runner's thread queuing tokens and starting fills
    start_delay_s: float = 0.0  # start_fill until the worker runs (its wake-up and the GIL)
    accept_s: float = 0.0  # the worker applying the step's tokens (one batched call)
    fill_s: float = 0.0  # the worker filling the mask (one batched call)
    window_s: float = 0.0  # start_fill until finish_fill is called: what the work hides under
    wait_s: float = 0.0  # the runner's thread blocked on a mask it needed: the critical path


@dataclass(eq=False)
class PendingBitmask:
    """A mask being filled: `host` is its [rows, ceil(V/32)] int32 buffer (pinned on a GPU)."""

    host: torch.Tensor
    done: Future  # -> bool: whether any row was filled (False: every grammar had ended)
    started: float = 0.0  # perf_counter at start_fill


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

    def start_fill(self, req_ids: list[str], device: torch.device) -> PendingBitmask:
        """Start applying the queued tokens and filling the mask of a step's sampling rows.
        Every older step's tokens must be queued already. Rows without a grammar, or whose
        grammar has ended, allow every token."""
        t = time.perf_counter()
        queued, self._queued = self._queued, []
        rows = self.rows
        live, indices = [], []
        for index, req_id in enumerate(req_ids):
            row = rows.get(req_id)
            if row is not None and not row.ended:
                live.append(row)
                indices.append(index)
        host = self._buffer(len(req_ids), device)
        if len(live) < len(req_ids):
            host.fill_(-1)  # all allowed; xgrammar overwrites the filled rows whole
        if live or queued:
            done = self._worker.submit(self._work, queued, live, host, indices, t)
        else:
            done = Future()
            done.set_result(False)
        self.stats.start_s += time.perf_counter() - t
        return PendingBitmask(host, done, t)

    def finish_fill(self, pending: PendingBitmask, device: torch.device) -> torch.Tensor | None:
        """Wait for a mask and start its copy to `device` (None: nothing to apply)."""
        t = time.perf_counter()
        filled = pending.done.result()
        stats = self.stats
        stats.wait_s += time.perf_counter() - t
        stats.window_s += t - pending.started
        if not filled:
            return None
        return pending.host.to(device, non_blocking=True)  # pinned: an asynchronous copy

    def fill_bitmask(self, req_ids: list[str], device: torch.device) -> torch.Tensor | None:
        """The synchronous fill: start_fill + finish_fill."""
        return self.finish_fill(self.start_fill(req_ids, device), device)

    def _buffer(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """One of two host buffers, alternating: the step before this one may still be copying
        out of the other. (Two steps back has finished: at most two are in flight.)"""
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
        live: list[_Row],
        host: torch.Tensor,
        indices: list[int],
        started: float,
    ) -> bool:
        t0 = time.perf_counter()
        self._accept(queued)
        t1 = time.perf_counter()
        matchers, filled = [], []
        for row, index in zip(live, indices):
            if row.ended:  # it ended with the token just applied: all allowed from now on
                host[index].fill_(-1)
            else:
                matchers.append(row.matcher)
                filled.append(index)
        if matchers:
            self._filler.batch_fill_next_token_bitmask(matchers, host, filled)
        t2 = time.perf_counter()
        stats = self.stats
        stats.start_delay_s += t0 - started
        stats.accept_s += t1 - t0
        if matchers:
            stats.fill_s += t2 - t1
            stats.num_fills += 1
            stats.num_rows_filled += len(matchers)
        return bool(matchers)

    def _accept(self, queued: list[tuple[_Row, int]]) -> None:
        """Advance matchers by their queued tokens, in order: one batched call a round (a
        matcher queued twice, which the runner does not do, takes a second round)."""
        while queued:
            seen: set[int] = set()
            batch, later = [], []
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
