"""CUDA graphs for decode steps: the whole model forward captured once per bucketed batch size.

An eager decode step of an 8B model issues ~400 kernel launches; at 10-60 us of host time each,
the GPU would wait on Python. A graph replays them all with one call.

Inputs live in InputBuffers' fixed device tensors; a batch of n decodes is padded to the next
captured size with rows whose KV slot is -1 (the KV write skips them) and whose outputs are ignored.
Host-side launch choices the kernels make from `max_seq_len` (the decode kernel's split-K grid)
are frozen at capture, so the attention backend names context buckets per batch size (one per
distinct choice) and a step replays the graph of the smallest bucket that holds its longest context.

With LoRA adapters (kiln.lora) every key is captured twice: with the LoRA kernels, and without
them for steps in which no token has an adapter (LoRAInputs.active), which then pay nothing for
LoRA being on.

On the CPU there are no graphs; `FakeGraph` stands in (it re-runs the captured function into the
same output tensor), so the bucketing, padding and static-buffer logic is testable anywhere.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING
from unittest import mock

import torch

from kiln.attention.backend import AttentionBackend, AttentionMetadata
from kiln.lora.layers import LoRAInputs
from kiln.models.base import CausalLM
from kiln.runtime.input_batch import InputBuffers

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger("kiln")

_SMALL_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
_LARGE_BATCH_STEP = 32


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, then every 32 up to max_num_seqs (always last).
    Padding wastes at most ~25% of a small step and 32 rows of a large one."""
    sizes = [b for b in _SMALL_BATCH_SIZES if b < max_num_seqs]
    b = _SMALL_BATCH_SIZES[-1] + _LARGE_BATCH_STEP
    while b < max_num_seqs:
        sizes.append(b)
        b += _LARGE_BATCH_STEP
    return [*sizes, max_num_seqs]


class FakeGraph:
    """torch.cuda.CUDAGraph's shape for the CPU: capture records the function, replay re-runs it
    and copies into the tensor capture returned, so callers see the same static output."""

    def __init__(self) -> None:
        self._fn: Callable[[], torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self._fn, self._out = fn, fn()
        return self._out

    def replay(self) -> None:
        assert self._fn is not None and self._out is not None, "replay before capture"
        self._out.copy_(self._fn())


class _CudaGraph:
    def __init__(self, pool: _POOL_HANDLE | None, capture_error_mode: str) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(
            self.graph, pool=self.pool, capture_error_mode=self.capture_error_mode
        ):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class GraphRunner:
    """Captures and replays decode forwards; `lookup` says whether a step can use one."""

    def __init__(
        self,
        model: CausalLM,
        ops: ModuleType,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        buffers: InputBuffers,
        max_num_seqs: int,
        max_model_len: int,
        fake: bool = False,
        lora_inputs: LoRAInputs | None = None,  # LoRA on: a second set, without its kernels
    ) -> None:
        self.model, self.ops, self.backend = model, ops, backend
        self.lora_inputs = lora_inputs
        self.kv_caches, self.buffers = kv_caches, buffers
        self.max_model_len = max_model_len
        self.fake = fake
        self.device = buffers.device
        self.batch_sizes = graph_batch_sizes(min(max_num_seqs, buffers.max_num_seqs))
        num_kv_heads = kv_caches[0][0].shape[2]
        self.seq_len_buckets = {
            b: backend.decode_graph_seq_lens(b, num_kv_heads, max_model_len, self.device)
            for b in self.batch_sizes
        }
        self.graphs: dict[tuple[int, int], tuple[FakeGraph | _CudaGraph, torch.Tensor]] = {}
        # LoRA on: the same keys captured without the LoRA kernels (steps without adapters).
        self.base_graphs: dict[tuple[int, int], tuple[FakeGraph | _CudaGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        # Where capture's time goes, summed over graphs: the eager warm-up forwards (first calls
        # of each kernel specialization) against recording and uploading the graphs.
        self.warmup_seconds = 0.0
        self.record_seconds = 0.0

    @property
    def num_graphs(self) -> int:
        return len(self.graphs) + len(self.base_graphs)

    def lookup(self, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """(padded batch size, context bucket) of the graph for this decode step, if any."""
        i = bisect.bisect_left(self.batch_sizes, num_seqs)
        if i == len(self.batch_sizes):
            return None
        batch = self.batch_sizes[i]
        buckets = self.seq_len_buckets[batch]
        j = bisect.bisect_left(buckets, max_seq_len)
        if j == len(buckets):
            return None
        return batch, buckets[j]

    def replay(self, key: tuple[int, int]) -> torch.Tensor:  # [padded batch, hidden]
        """The step's graph: without the LoRA kernels when none of its tokens has an adapter."""
        lora = self.lora_inputs
        graphs = self.base_graphs if lora is not None and not lora.active else self.graphs
        graph, hidden = graphs[key]
        graph.replay()
        return hidden

    def _forward(self, num_seqs: int, max_seq_len: int) -> torch.Tensor:
        buf = self.buffers
        metadata = AttentionMetadata(
            slot_mapping=buf.slot_mapping[:num_seqs],
            query_start_loc=buf.query_start_loc[: num_seqs + 1],
            seq_lens=buf.seq_lens[:num_seqs],
            block_tables=buf.block_tables[:num_seqs],  # full width: any context up to the bucket
            num_decodes=num_seqs,
            max_query_len=1,
            max_seq_len=max_seq_len,
        )
        if buf.num_groups > 1:  # a hybrid model: each group's tables too, at full width
            metadata = buf.with_groups(metadata, num_seqs, num_seqs, buf.table_row_stride)
        return self.model(
            self.ops,
            self.backend,
            buf.input_ids[:num_seqs],
            buf.positions[:num_seqs],
            self.kv_caches,
            metadata,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (batch size, context bucket), largest first so that smaller graphs reuse
        the memory pool the largest one sized."""
        buf = self.buffers
        buf.wait_for_copies()
        # Padding-shaped inputs: every row skips the KV write and reads one key of block 0.
        size = self.batch_sizes[-1]
        buf.input_ids[:size].zero_()
        buf.positions[:size].zero_()
        for slot_mapping in buf.group_slot_mappings:
            slot_mapping[:size].fill_(-1)
        buf.seq_lens[:size].fill_(1)
        buf.query_start_loc[: size + 1].copy_(torch.arange(size + 1, dtype=torch.int32))
        buf.group_block_tables[:, :size].zero_()
        keys = [(b, c) for b in self.batch_sizes for c in self.seq_len_buckets[b]]
        start = time.perf_counter()
        cuda = self.device.type == "cuda" and not self.fake
        pool = torch.cuda.graph_pool_handle() if cuda else None
        # Under TP, NCCL's watchdog thread polls the events of earlier collectives while this
        # thread captures: "global" mode would count its polls as unsafe calls made during the
        # capture and invalidate it, so only this thread's calls are checked there.
        parallel = getattr(self.model, "parallel", None) is not None
        error_mode = "thread_local" if parallel else "global"
        reserved_before = torch.cuda.memory_reserved(self.device) if cuda else 0
        sets = [(True, self.graphs)]
        if self.lora_inputs is not None:
            sets.append((False, self.base_graphs))
        with _fast_capture(cuda):
            for with_lora, graphs in sets:
                if self.lora_inputs is not None:
                    self.lora_inputs.active = with_lora  # what the layers' apply reads
                for key in sorted(keys, reverse=True):
                    graphs[key] = self._capture_one(key, cuda, pool, error_mode)
        if self.lora_inputs is not None:
            self.lora_inputs.active = True
        if cuda:
            torch.cuda.synchronize(self.device)
            self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d decode graphs (batch sizes %s) in %.1f s, %.2f GiB",
            self.num_graphs,
            self.batch_sizes,
            self.capture_seconds,
            self.pool_bytes / 2**30,
        )

    def _capture_one(
        self, key: tuple[int, int], cuda: bool, pool: _POOL_HANDLE | None, error_mode: str
    ) -> tuple[FakeGraph | _CudaGraph, torch.Tensor]:
        t0 = time.perf_counter()
        self._forward(*key)  # warm-up: compiles kernels, picks cuBLAS algorithms
        if cuda:
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        graph = _CudaGraph(pool, error_mode) if cuda else FakeGraph()
        hidden = graph.capture(functools.partial(self._forward, *key))
        # The first replay uploads the graph: not in a timed step. Not waited for: it runs on
        # the GPU while the host launches the next key's warm-up behind it on the same stream
        # (whose synchronize above covers it), so the ~3-10 ms a replay of the 8B model takes
        # is not added to the host's time 26 times over.
        graph.replay()
        self.warmup_seconds += t1 - t0
        self.record_seconds += time.perf_counter() - t1
        return graph, hidden


@contextlib.contextmanager
def _fast_capture(cuda: bool):
    """torch.cuda.graph runs gc.collect() and empty_cache() before every capture; over dozens of
    graphs that is seconds of startup for nothing (vLLM skips them the same way)."""
    if not cuda:
        yield
        return
    gc.collect()
    with mock.patch("gc.collect", lambda *a, **k: 0), mock.patch("torch.cuda.empty_cache"):
        yield
