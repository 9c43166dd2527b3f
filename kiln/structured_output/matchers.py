"""Per-request grammar matchers and each step's allowed-token bitmask, filled off the main thread.

The runner's thread owns the matchers: it adds, removes and advances them (accept_tokens). A
step's mask is filled by a worker (start_fill) while the runner's thread goes on with the rest
of the step loop (collecting the previous step, scheduling, preparing the next); finish_fill
waits for it just before the sampler needs it. The worker first waits until the older steps'
tokens have been accepted (the events it is given), so the two threads never use a matcher at
the same time. xgrammar releases the GIL while it fills, so the worker runs beside Python work,
and the rows are split over `fill_threads` threads of a pool that lives as long as the batch
(xgrammar's own BatchGrammarMatcher(n) starts and joins n threads on every call).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kiln.envs import envs
from kiln.sampling_params import GuidedDecodingParams
from kiln.structured_output.compiler import GrammarCompilerCache

logger = logging.getLogger("kiln")

MAX_FILL_THREADS = 8  # rows are ~0.01-0.4 ms each: more threads than this mostly wait on a lock


def default_fill_threads() -> int:
    """KILN_GRAMMAR_FILL_THREADS, else half the CPUs this process may run on (the other half
    runs the engine loop, the tokenizer and CUDA's own threads), at most MAX_FILL_THREADS."""
    if envs().grammar_fill_threads > 0:
        return envs().grammar_fill_threads
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count())
    return max(1, min(MAX_FILL_THREADS, len(usable) // 2))


@dataclass
class GrammarStats:
    """Host seconds spent on masks, summed over steps (benchmarks read them)."""

    num_fills: int = 0
    num_rows_filled: int = 0
    fill_s: float = 0.0  # the worker's wall time filling (after its waits)
    fill_cpu_s: float = 0.0  # CPU time of every fill thread, summed
    wait_s: float = 0.0  # the runner's thread blocked on a mask it needed: the critical path
    accept_s: float = 0.0  # the runner's thread advancing matchers


@dataclass(eq=False)
class PendingBitmask:
    """A mask being filled: `host` is its [rows, ceil(V/32)] int32 buffer (pinned on a GPU)."""

    host: torch.Tensor
    done: Future  # -> bool: whether any row was filled (False: every grammar had ended)


class GrammarBatch:
    """The runner's matchers, keyed by request id. A request rebuilt after preemption is added
    again with its output so far, which the new matcher replays."""

    def __init__(self, compiler: GrammarCompilerCache, fill_threads: int | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.compiler = compiler
        self.matchers: dict[str, Any] = {}
        self.fill_threads = fill_threads or default_fill_threads()
        self.stats = GrammarStats()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
        self._helpers = (
            ThreadPoolExecutor(self.fill_threads - 1, thread_name_prefix="kiln-grammar-fill")
            if self.fill_threads > 1
            else None
        )
        # One serial batch matcher per fill thread: max_threads=1 starts no threads of its own.
        self._fillers = [xgr.BatchGrammarMatcher(1) for _ in range(self.fill_threads)]
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._slot = 0

    # ---- the runner's thread --------------------------------------------------------------

    def add(self, req_id: str, spec: GuidedDecodingParams, output_token_ids: list[int]) -> None:
        matcher = self._xgr.GrammarMatcher(self.compiler.compile(spec))
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                break
        self.matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def accept_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Advance the matchers of a step's rows by the tokens sampled for them."""
        t = time.perf_counter()
        live, tokens, names = [], [], []
        for req_id, token_id in zip(req_ids, token_ids):
            matcher = self.matchers.get(req_id)
            if matcher is not None and not matcher.is_terminated():
                live.append(matcher)
                tokens.append(token_id)
                names.append(req_id)
        if live:
            accepted = self._xgr.BatchGrammarMatcher.batch_accept_token(live, tokens)
            for req_id, token_id, ok in zip(names, tokens, accepted):
                if not ok:  # cannot happen for a token the mask allowed
                    logger.warning("request %s: token %d rejected by its grammar", req_id, token_id)
        self.stats.accept_s += time.perf_counter() - t

    def start_fill(
        self, req_ids: list[str], device: torch.device, wait_for: list[threading.Event]
    ) -> PendingBitmask | None:
        """Start filling the mask of a step's sampling rows (None if no row has a grammar).
        `wait_for`: set once every older step's tokens are accepted. Rows without a grammar, or
        whose grammar has ended, allow every token."""
        rows = [(row, self.matchers.get(req_id)) for row, req_id in enumerate(req_ids)]
        rows = [(row, matcher) for row, matcher in rows if matcher is not None]
        if not rows:
            return None
        host = self._buffer(len(req_ids), device)
        host.fill_(-1)  # all allowed; the worker overwrites the grammar rows whole
        return PendingBitmask(host, self._worker.submit(self._fill, rows, host, wait_for))

    def finish_fill(self, pending: PendingBitmask, device: torch.device) -> torch.Tensor | None:
        """Wait for a mask and start its copy to `device` (None: nothing to apply)."""
        t = time.perf_counter()
        filled = pending.done.result()
        self.stats.wait_s += time.perf_counter() - t
        if not filled:
            return None
        return pending.host.to(device, non_blocking=True)  # pinned: an asynchronous copy

    def fill_bitmask(self, req_ids: list[str], device: torch.device) -> torch.Tensor | None:
        """The synchronous fill: start_fill + finish_fill with nothing to wait for."""
        pending = self.start_fill(req_ids, device, [])
        return None if pending is None else self.finish_fill(pending, device)

    def _buffer(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """One of two host buffers, alternating: the step before this one may still be copying
        out of the other. (Two steps back has finished: at most two are in flight.)"""
        self._slot ^= 1
        buf = self._buffers[self._slot]
        if buf is None or buf.shape[0] < num_rows:
            words = -(-self.compiler.vocab_size // 32)
            pin = device.type == "cuda"
            buf = torch.empty((max(num_rows, 64), words), dtype=torch.int32, pin_memory=pin)
            self._buffers[self._slot] = buf
        return buf[:num_rows]

    # ---- the worker -----------------------------------------------------------------------

    def _fill(
        self, rows: list[tuple[int, Any]], host: torch.Tensor, wait_for: list[threading.Event]
    ) -> bool:
        for event in wait_for:
            event.wait()
        t, cpu = time.perf_counter(), time.thread_time()
        live = [(row, matcher) for row, matcher in rows if not matcher.is_terminated()]
        if not live:
            return False
        # Interleaved slices: rows inside strings cost ~30x the others and tend to cluster.
        k = min(self.fill_threads, len(live))
        slices = [live[i::k] for i in range(k)]
        helpers = [self._helpers.submit(self._fill_slice, i, slices[i], host) for i in range(1, k)]
        cpu_s = self._fill_slice(0, slices[0], host)
        cpu_s += sum(f.result() for f in helpers)
        stats = self.stats
        stats.num_fills += 1
        stats.num_rows_filled += len(live)
        stats.fill_s += time.perf_counter() - t
        stats.fill_cpu_s += cpu_s + time.thread_time() - cpu
        return True

    def _fill_slice(self, index: int, rows: list[tuple[int, Any]], host: torch.Tensor) -> float:
        cpu = time.thread_time()
        self._fillers[index].batch_fill_next_token_bitmask(
            [matcher for _, matcher in rows], host, [row for row, _ in rows]
        )
        return time.thread_time() - cpu if index else 0.0  # slice 0's is the worker's own
