"""Per-request grammar matchers and each step's allowed-token bitmask, filled off the main thread.

The runner's thread owns the matchers: it adds, removes and advances them (accept_tokens), and
starts a step's fill (start_fill) once every older step's tokens are in them. A worker thread
then fills the mask while the runner's thread goes on with the step loop (collecting, scheduling,
preparing the next step); finish_fill waits for it just before the sampler needs it. Between the
two calls the runner's thread leaves the matchers alone. xgrammar releases the GIL while it
fills, and splits the rows over its own C++ threads (`fill_threads`), which never need the GIL:
the worker takes it once to start and once to hand the result back.
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
# worker must start filling while the runner's thread runs Python, not once it blocks.
GIL_SWITCH_INTERVAL_S = 0.0005


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
    fill_s: float = 0.0  # the worker's wall time filling
    wait_s: float = 0.0  # the runner's thread blocked on a mask it needed: the critical path
    accept_s: float = 0.0  # the runner's thread advancing matchers and starting fills


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
        self._filler = xgr.BatchGrammarMatcher(self.fill_threads)  # 1: fills in the caller
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._slot = 0
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

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

    def has_grammar(self, req_ids: list[str]) -> bool:
        matchers = self.matchers
        return any(req_id in matchers for req_id in req_ids)

    def start_fill(self, req_ids: list[str], device: torch.device) -> PendingBitmask:
        """Start filling the mask of a step's sampling rows. Every older step's tokens must be
        accepted already. Rows without a grammar, or whose grammar has ended, allow every
        token."""
        t = time.perf_counter()
        rows, live = [], []
        for row, req_id in enumerate(req_ids):
            matcher = self.matchers.get(req_id)
            if matcher is not None and not matcher.is_terminated():
                rows.append(row)
                live.append(matcher)
        host = self._buffer(len(req_ids), device)
        if live:
            host.fill_(-1)  # all allowed; xgrammar overwrites the grammar rows whole
            done = self._worker.submit(self._fill, live, host, rows)
        else:
            done = Future()
            done.set_result(False)
        self.stats.accept_s += time.perf_counter() - t
        return PendingBitmask(host, done)

    def finish_fill(self, pending: PendingBitmask, device: torch.device) -> torch.Tensor | None:
        """Wait for a mask and start its copy to `device` (None: nothing to apply)."""
        t = time.perf_counter()
        filled = pending.done.result()
        self.stats.wait_s += time.perf_counter() - t
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

    def _fill(self, matchers: list[Any], host: torch.Tensor, rows: list[int]) -> bool:
        t = time.perf_counter()
        self._filler.batch_fill_next_token_bitmask(matchers, host, rows)
        stats = self.stats
        stats.num_fills += 1
        stats.num_rows_filled += len(rows)
        stats.fill_s += time.perf_counter() - t
        return True
