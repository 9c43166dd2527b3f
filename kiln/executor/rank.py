"""One rank's data plane: load the model (or this rank's part of it), plan the KV cache, make the
model runner. The in-process executor builds one with no `parallel`; under TP/PP every rank
builds its own, and the KV blocks are the minimum over all ranks."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch

from kiln.checkpoint.engine_dir import runtime_defaults
from kiln.config import EngineConfig
from kiln.distributed.comm import all_reduce_min, barrier
from kiln.distributed.parallel_state import ParallelContext
from kiln.executor.base import KVCapacity, ModelFacts
from kiln.lora.model import LoRAModel
from kiln.models.base import CausalLM
from kiln.runtime.cpu_threads import choose_threads
from kiln.runtime.memory_plan import MemoryPlan, plan_kv_blocks
from kiln.runtime.model_loader import (
    LoadedModel,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from kiln.runtime.model_runner import ModelRunner
from kiln.spec_decode.eagle3.head import Eagle3Head
from kiln.spec_decode.factory import build_proposer, load_draft_model, load_eagle3

logger = logging.getLogger("kiln")


@dataclass
class Rank:
    facts: ModelFacts
    memory_plan: MemoryPlan
    capacity: KVCapacity
    runner: ModelRunner
    # Seconds per phase: load_s, plan_s, runner_s (graphs included); load_phases: load_s's parts.
    startup: dict[str, object]


def rank_device(name: str, parallel: ParallelContext | None) -> torch.device:
    """The device of this rank: under TP/PP on CUDA, GPU LOCAL_RANK (set by torchrun or by kiln's
    launcher) unless an index is given."""
    device = resolve_device(name)
    if parallel is not None and device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # NCCL's communicators bind to the current device
    return device


def build_rank(config: EngineConfig, parallel: ParallelContext | None = None) -> Rank:
    config = _rank_config(config, parallel)
    device = rank_device(config.device, parallel)
    dtype = resolve_dtype(config.dtype, device)
    if device.type == "cpu" and dtype == torch.float16:
        logger.warning(
            "dtype float16 on the CPU runs slower than float32 (PyTorch's CPU kernels convert "
            "half values op by op); float32 is the CPU's default (--dtype auto)"
        )
    torch.manual_seed(config.seed)
    threads = _set_threads(config, device)
    t_start = time.perf_counter()
    loaded = load_model(config, device, dtype, parallel)
    t_loaded = time.perf_counter()
    if parallel is not None:
        barrier(parallel)  # the GPU memory profile's forward has collectives of the step timeout
    kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    facts = ModelFacts(
        config=loaded.config,
        tokenizer=loaded.tokenizer,
        generation_defaults=loaded.generation_defaults,
        description=loaded.description,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(kv_cache_dtype).removeprefix("torch."),
    )
    max_model_len = _max_model_len(config, loaded)
    spec = config.speculative
    draft: CausalLM | Eagle3Head | None = None
    if spec is not None and spec.method == "draft_model":
        draft = load_draft_model(config, spec, loaded, device, dtype, load_model)
    elif spec is not None and spec.method == "eagle3":
        draft = load_eagle3(config, spec, loaded, device, dtype)
    lora = None
    if config.enable_lora:  # before the plan: the slots are weights, their shrink activations
        lora = LoRAModel(
            loaded.model,
            config.max_loras,
            config.max_lora_rank,
            max(config.max_num_batched_tokens, config.max_num_seqs),
        )
    memory_plan = plan_kv_blocks(
        config, loaded.model, max_model_len, device, kv_cache_dtype, draft_model=draft
    )
    if parallel is not None:
        # Every rank holds the same blocks (of its own heads and layers): the fewest that fit.
        fewest = all_reduce_min(parallel, memory_plan.num_blocks)
        memory_plan = dataclasses.replace(memory_plan, num_blocks=fewest)
    num_blocks = memory_plan.num_blocks
    t_planned = time.perf_counter()
    # Every admitted request must fit the cache on its own, or preemption could never help.
    # (A windowed group holds at most a window and a step of a request: memory_plan.groups.)
    capped = memory_plan.longest_fitting(max_model_len)
    if capped < max_model_len:
        logger.warning(
            "KV cache holds %d tokens: max_model_len lowered from %d", capped, max_model_len
        )
    capacity = KVCapacity(num_blocks, config.block_size, capped)
    if parallel is None or parallel.rank == 0:
        _log_startup(facts, threads, memory_plan, capacity)
    runner = _make_runner(config, loaded, capacity, kv_cache_dtype, draft, lora)
    startup: dict[str, object] = {
        "load_s": t_loaded - t_start,
        "plan_s": t_planned - t_loaded,
        "runner_s": time.perf_counter() - t_planned,
        "load_phases": loaded.phases,  # load_s's parts
    }
    return Rank(facts, memory_plan, capacity, runner, startup)


def _set_threads(config: EngineConfig, device: torch.device) -> str:
    """torch's intra-op threads: the config's, else on the CPU what the machine has free
    (kiln.runtime.cpu_threads); on a GPU torch's default. Returns the start-up log's words."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
        return f"{config.num_threads} (--threads)"
    if device.type != "cpu":
        return f"{torch.get_num_threads()} (torch's default)"
    choice = choose_threads()
    torch.set_num_threads(choice.threads)
    return f"{choice.threads} ({choice.reason})"


def _log_startup(facts: ModelFacts, threads: str, plan: MemoryPlan, capacity: KVCapacity) -> None:
    """What vLLM says as it starts: the model, dtype, threads, memory plan and KV capacity."""
    # kiln.startup: the CLI and the engine process show it at INFO on stderr.
    log = logging.getLogger("kiln.startup")
    log.info("model: %s", facts.description)
    log.info("device %s, dtype %s, KV cache %s", facts.device, facts.dtype, facts.kv_cache_dtype)
    log.info("CPU threads: %s", threads)
    log.info("memory plan: %s", plan.describe(capacity.max_model_len))
    log.info(
        "KV cache: %d tokens (%d blocks of %d); context %d tokens",
        capacity.num_blocks * capacity.block_size, capacity.num_blocks, capacity.block_size,
        capacity.max_model_len,
    )  # fmt: skip


def _rank_config(config: EngineConfig, parallel: ParallelContext | None) -> EngineConfig:
    """The config this rank runs: an engine directory's recorded runtime defaults where the
    config chose nothing, and eager steps under pipeline parallelism."""
    # An engine directory built with --kv-cache-dtype / --max-model-len runs with them unless
    # the config chooses otherwise ("auto" and None are not choices).
    unset = {
        k: v
        for k, v in runtime_defaults(config.model).items()
        if getattr(config, k) in ("auto", None)
    }
    config = dataclasses.replace(config, **unset)
    if parallel is not None and config.speculative_config is not None:
        raise ValueError(
            "speculative decoding is not supported with tensor or pipeline parallelism yet"
        )
    if parallel is not None and parallel.pp_size > 1:
        # Tensor ranks capture their decode graphs with the all-reduces inside; pipeline stages
        # run eager: their send/recv between stages would sit inside the graphs (not built), and
        # the memory plan then reserves no graph pool.
        config = dataclasses.replace(config, enforce_eager=True)
    return config


def _max_model_len(config: EngineConfig, loaded: LoadedModel) -> int:
    """The context the config asks for, or the model's (sliding windows attend past it)."""
    return config.max_model_len or loaded.config.max_position_embeddings


def _make_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    capacity: KVCapacity,
    kv_cache_dtype: torch.dtype,
    draft: CausalLM | Eagle3Head | None,
    lora: LoRAModel | None = None,
) -> ModelRunner:
    """The model runner over `capacity`'s blocks, with its proposer when speculation is on."""
    spec = config.speculative
    proposer = None
    if spec is not None:
        proposer = build_proposer(
            spec,
            loaded.config.vocab_size,
            draft_model=draft,
            num_blocks=capacity.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=capacity.max_model_len,
            attention_backend=config.attention_backend,
            kv_cache_dtype=kv_cache_dtype,
            max_num_batched_tokens=config.max_num_batched_tokens,
            target_embedding=loaded.model.embed_tokens,
        )
    return ModelRunner(
        loaded.model,
        capacity.num_blocks,
        config.block_size,
        tuple(loaded.config.eos_token_ids),
        attention_backend=config.attention_backend,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=capacity.max_model_len,
        enforce_eager=config.enforce_eager,
        kv_cache_dtype=kv_cache_dtype,
        tokenizer=loaded.tokenizer,
        proposer=proposer,
        lora=lora,
    )
