"""Per-request grammar matchers and the step's allowed-token bitmask."""

from __future__ import annotations

import logging
from typing import Any

import torch

from kiln.sampling_params import GuidedDecodingParams
from kiln.structured_output.compiler import GrammarCompilerCache

logger = logging.getLogger("kiln")


class GrammarBatch:
    """The runner's matchers, keyed by request id. A request rebuilt after preemption is added
    again with its output so far, which the new matcher replays."""

    def __init__(self, compiler: GrammarCompilerCache) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.compiler = compiler
        self.matchers: dict[str, Any] = {}
        self._batch = xgr.BatchGrammarMatcher()

    def add(self, req_id: str, spec: GuidedDecodingParams, output_token_ids: list[int]) -> None:
        matcher = self._xgr.GrammarMatcher(self.compiler.compile(spec))
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                break
        self.matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def accept(self, req_id: str, token_id: int) -> None:
        matcher = self.matchers.get(req_id)
        if matcher is None or matcher.is_terminated():
            return
        if not matcher.accept_token(token_id):  # cannot happen for a token the mask allowed
            logger.warning("request %s: token %d rejected by its grammar", req_id, token_id)

    def fill_bitmask(self, req_ids: list[str], device: torch.device) -> torch.Tensor | None:
        """[rows, ceil(V/32)] int32 on `device` for a step's sampling rows (None if no row has a
        grammar). Rows without one, or whose grammar has ended, allow every token."""
        rows, matchers = [], []
        for row, req_id in enumerate(req_ids):
            matcher = self.matchers.get(req_id)
            if matcher is not None and not matcher.is_terminated():
                rows.append(row)
                matchers.append(matcher)
        if not matchers:
            return None
        bitmask = self._xgr.allocate_token_bitmask(len(req_ids), self.compiler.vocab_size)
        if device.type == "cuda":
            bitmask = bitmask.pin_memory()  # so the copy below is asynchronous
        # Several threads when many rows have grammars (xgrammar's batch matcher).
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return bitmask.to(device, non_blocking=True)
