"""The scheduler's record of the most sequences run at once (kiln.engine.occupancy), with fake
model outputs over the KV managers of real shapes: the settings of the suite's `*_long32k_fit`
rows (benchmarks/run_suite.sh: 32640-token prompts and 128 tokens out, 8192 tokens a step, a
16 GiB float8 pool) run as many sequences at once as the memory plan says fit. Gemma-3-12B's
windowed layers hold their window, so 12 fit where every layer keeping its whole context would
hold 2; Llama-3.1-8B, without windows, 8 either way. Synchronous and with a step in flight (the
GPU's async scheduling)."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from kiln.config import EngineConfig
from kiln.engine.scheduler import Scheduler
from kiln.kv_cache.hybrid import HybridKVCacheManager
from kiln.kv_cache.manager import KVCacheManager
from kiln.models.config import PRESETS, ModelConfig
from kiln.runtime.memory_plan import GiB, MemoryPlan, group_plans
from tests.engine.test_scheduler import _drive, make_request

PROMPT, OUTPUT, STEP, POOL_GIB = 32640, 128, 8192, 16
BLOCK, NUM_REQUESTS, MAX_NUM_SEQS = 16, 16, 64
_REPO = pathlib.Path(__file__).resolve().parents[2]


def _plan_and_scheduler(preset: str) -> tuple[MemoryPlan, Scheduler]:
    cfg = ModelConfig.from_hf_dict(PRESETS[preset])
    length = PROMPT + OUTPUT
    groups = group_plans(cfg, EngineConfig(max_num_batched_tokens=STEP), length)
    layout = cfg.kv_cache_layout
    layer_token = 2 * cfg.num_key_value_heads * cfg.head_dim  # K and V, a byte each
    per_block = layout.num_slots * layer_token * BLOCK  # what kv_bytes_per_block makes
    num_blocks = POOL_GIB * GiB // per_block
    plan = MemoryPlan(0, per_block, POOL_GIB * GiB, num_blocks, BLOCK, groups=groups,
                      layer_token_bytes=layer_token)  # fmt: skip
    kv: KVCacheManager | HybridKVCacheManager
    if layout.is_hybrid:
        kv = HybridKVCacheManager(num_blocks, BLOCK, True, windows=layout.windows)
    else:
        kv = KVCacheManager(num_blocks, BLOCK, True)
    return plan, Scheduler(kv, MAX_NUM_SEQS, STEP, length)


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize(("preset", "fit", "every_layer"), [
    ("gemma-3-12b", 12, 2), ("llama-3.1-8b", 8, 8),
])  # fmt: skip
def test_as_many_32k_sequences_run_at_once_as_the_plan_fits(preset, fit, every_layer, lag):
    plan, s = _plan_and_scheduler(preset)
    length = PROMPT + OUTPUT
    assert plan.max_concurrent_seqs(length) == fit
    assert plan.sequences_keeping_every_layer(length) == every_layer
    for i in range(NUM_REQUESTS):
        s.add_request(make_request(f"r{i}", PROMPT, OUTPUT, arrival=float(i), ignore_eos=True))
    _drive(s, lag)
    occupancy = s.occupancy
    assert occupancy.peak_sequences == fit
    assert fit * plan.blocks_per_seq(PROMPT) <= occupancy.blocks_at_peak <= plan.num_blocks
    # A further request started its prompt and was preempted (or waited) for want of blocks.
    assert occupancy.peak_running == fit + 1


def test_a_prompt_part_way_through_is_running_but_not_counted_as_a_sequence_at_once():
    _, s = _plan_and_scheduler("llama-3.1-8b")
    s.add_request(make_request("r", PROMPT, OUTPUT, ignore_eos=True))
    s.schedule()  # its first 8192 tokens
    assert (s.occupancy.peak_running, s.occupancy.peak_sequences) == (1, 0)
    assert s.occupancy.peak_blocks == STEP // BLOCK


def test_the_suite_rows_run_these_settings():
    listing = subprocess.run(
        ["bash", "benchmarks/run_suite.sh", "--list", "gemma-3-12b_fp8dyn_long32k_fit"],
        cwd=_REPO, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHON": "true"},  # no torch import for the card's size: a listing
    ).stdout  # fmt: skip
    flags = listing.split()
    value = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--")}
    assert value["--model"] == "gemma-3-12b" and value["--kv-cache-dtype"] == "fp8"
    assert (value["--input-len"], value["--output-len"]) == (str(PROMPT), str(OUTPUT))
    assert value["--max-num-batched-tokens"] == str(STEP)
    assert value["--kv-cache-memory-gb"] == str(POOL_GIB)
    assert value["--max-model-len"] == str(PROMPT + OUTPUT)
    assert (value["--num-requests"], value["--max-num-seqs"]) == (
        str(NUM_REQUESTS),
        str(MAX_NUM_SEQS),
    )
