"""One model runner in this process, on one device: load, plan the KV cache, run steps."""

from __future__ import annotations

import logging

import torch

from kiln.config import EngineConfig
from kiln.executor.base import Executor, ExecutorStats, KVCapacity, ModelFacts
from kiln.interfaces import ModelRunnerOutput, SchedulerOutput
from kiln.runtime.memory_plan import plan_kv_blocks
from kiln.runtime.model_loader import (
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from kiln.runtime.model_runner import ModelRunner
from kiln.spec_decode.factory import build_proposer, load_draft_model

logger = logging.getLogger("kiln")


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        torch.manual_seed(config.seed)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config, device, dtype)
        kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        self.facts = ModelFacts(
            config=loaded.config,
            tokenizer=loaded.tokenizer,
            generation_defaults=loaded.generation_defaults,
            description=loaded.description,
            device=str(device),
            dtype=str(dtype).removeprefix("torch."),
            kv_cache_dtype=str(kv_cache_dtype).removeprefix("torch."),
        )
        max_model_len = config.max_model_len or loaded.config.max_position_embeddings
        window = loaded.config.sliding_window
        if window is not None and window < max_model_len:
            # Sliding-window attention is not built: within the window it equals full attention,
            # so cap the context there rather than compute something else past it.
            logger.warning("sliding window %d: max_model_len capped to it", window)
            max_model_len = window
        spec = config.speculative
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft_model(config, spec, loaded, device, dtype, load_model)
        self.memory_plan = plan_kv_blocks(
            config, loaded.model, max_model_len, device, kv_cache_dtype, draft_model=draft
        )
        num_blocks = self.memory_plan.num_blocks
        # Every admitted request must fit the cache on its own, or preemption could never help.
        capped = min(max_model_len, num_blocks * config.block_size)
        if capped < max_model_len:
            logger.warning(
                "KV cache holds %d tokens: max_model_len lowered from %d", capped, max_model_len
            )
        self._capacity = KVCapacity(num_blocks, config.block_size, capped)
        self.runner = ModelRunner(
            loaded.model,
            num_blocks,
            config.block_size,
            tuple(loaded.config.eos_token_ids),
            attention_backend=config.attention_backend,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=capped,
            enforce_eager=config.enforce_eager,
            kv_cache_dtype=kv_cache_dtype,
            proposer=None
            if spec is None
            else build_proposer(
                spec,
                loaded.config.vocab_size,
                draft_model=draft,
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_model_len=capped,
                attention_backend=config.attention_backend,
                kv_cache_dtype=kv_cache_dtype,
                max_num_batched_tokens=config.max_num_batched_tokens,
            ),
        )

    def kv_capacity(self) -> KVCapacity:
        return self._capacity

    def submit(self, step: SchedulerOutput) -> bool:
        return self.runner.submit(step)

    def collect(self) -> ModelRunnerOutput:
        return self.runner.collect()

    def enable_step_timing(self) -> None:
        self.runner.step_timing = {}

    def shutdown(self) -> None:
        pass  # the runner's tensors go with the executor

    def stats(self) -> ExecutorStats:
        graphs = self.runner.graphs
        cuda_graphs = None
        if graphs is not None:
            cuda_graphs = {
                "num_graphs": graphs.num_graphs,
                "batch_sizes": graphs.batch_sizes,
                "capture_s": graphs.capture_seconds,
                "pool_gib": graphs.pool_bytes / 2**30,
            }
        return ExecutorStats(self.memory_plan, cuda_graphs, self.runner.step_timing)
