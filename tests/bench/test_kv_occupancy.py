"""`kiln bench throughput` reports the most sequences it ran at once beside the memory plan's
count of those that fit: on a tiny Gemma 3 (two layers of window 7, one global) whose windowed
layers hold only their window, as many long sequences ran at once as the plan says, more than
the same memory holds when every layer keeps its whole context, which the same model without
windows (every layer global) then runs, in the same bytes."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from kiln.cli.main import main
from tests.models.family_checks import save_tiny_hf
from tests.models.test_gemma2_gemma3 import VARIANTS

_REPO = pathlib.Path(__file__).resolve().parents[2]
BLOCK = 4
PROMPT, OUTPUT = 480, 24  # 504 tokens: 126 blocks in the global layer, 4 in each windowed one
# Tokens a step: a prompt in four chunks, so that sequences start faster than they end and the
# pool, not the prompts' pace, limits how many run at once; 32 blocks of room in each windowed
# group for a chunk.
STEP = 128
# One layer's K and V of a block in fp32 (a pool block of the windowed model holds one layer):
# 2 KV heads x 32 dims x 2 x 4 bytes x 4 tokens.
BLOCK_BYTES = 2 * 32 * 2 * 4 * BLOCK
# Room for one step and four sequences of 126 + 2 x 4 blocks, and a block to spare; not for
# five at their least (121 + 2 x 2 blocks, their prompts and a token).
POOL_BLOCKS = 2 * STEP // BLOCK + 4 * 134 + 1


def _bench(path: str, tmp_path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    budget = POOL_BLOCKS * BLOCK_BYTES / (1 << 30)  # a power-of-two fraction: exact in a float
    args = ["bench", "throughput", "--model", path, "--num-requests", "8",
            "--input-len", str(PROMPT), "--output-len", str(OUTPUT), "--block-size", str(BLOCK),
            "--max-num-batched-tokens", str(STEP), "--max-num-seqs", "8",
            "--max-model-len", str(PROMPT + OUTPUT), "--kv-cache-memory-gb", repr(budget),
            "--warmup", "0", "--no-progress", "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def gemma3_paths(tmp_path_factory) -> dict[str, str]:
    model_type, hf_class, overrides = VARIANTS["gemma3"]
    paths = {}
    for name, extra in (("windowed", {}), ("global", {"layer_types": ["full_attention"] * 3})):
        path = str(tmp_path_factory.mktemp(name) / "src")
        save_tiny_hf(path, model_type, hf_class, **{**overrides, **extra})
        paths[name] = path
    return paths


def test_as_many_long_sequences_ran_at_once_as_the_plan_fits(gemma3_paths, tmp_path) -> None:
    windowed = _bench(gemma3_paths["windowed"], tmp_path, "windowed")
    occupancy, plan = windowed["kv_occupancy"], windowed["memory_plan"]
    assert plan["kv_blocks"] == POOL_BLOCKS
    # The plan: (601 - 64) // 134 = 4 sequences of 504 tokens; every layer keeping all 504
    # tokens (378 blocks of one layer each): 601 // 378 = 1.
    assert plan["sequences_that_fit"] == {"504": {"planned": 4, "every_layer": 1}}
    assert "4 x 504 (layers of window 7 counted at it" in plan["summary"]
    assert occupancy["context_len"] == PROMPT + OUTPUT
    assert (occupancy["plan_sequences"], occupancy["plan_sequences_every_layer"]) == (4, 1)
    # What ran: four sequences with their whole context in the cache at once, within the pool.
    assert occupancy["peak_sequences"] == 4
    assert 4 * (121 + 2 * 2) <= occupancy["blocks_at_peak"] <= POOL_BLOCKS
    assert occupancy["peak_running"] >= occupancy["peak_sequences"]

    # The same model with every layer global, in the same bytes: a pool block holds all three
    # layers (200 blocks), a sequence 126 of them: 1 at once, what the windowed plan said of it.
    every = _bench(gemma3_paths["global"], tmp_path, "global")
    assert every["memory_plan"]["kv_blocks"] == POOL_BLOCKS // 3
    assert every["memory_plan"]["sequences_that_fit"] == {"504": {"planned": 1, "every_layer": 1}}
    assert every["kv_occupancy"]["peak_sequences"] == 1 < occupancy["peak_sequences"]

    # The suite's summary line puts the peak beside the plan's counts.
    summary = subprocess.run(
        [sys.executable, "benchmarks/bench_summary.py", str(tmp_path / "windowed.json")],
        cwd=_REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "at once 4 x 504 (plan 4, every layer 1)" in summary
