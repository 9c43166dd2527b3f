"""A hybrid model's KV cache groups end to end (tiny Gemma 3: two local layers of window 7, one
global; blocks of 4): during a long generation the windowed groups hold a window's blocks while
the full group grows; decode steps replayed through (fake) graphs read each group's table; a
next turn hits the cache after the windowed groups gave their early blocks back. Greedy tokens
equal Hugging Face's in fp32 throughout."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.kv_cache.manager import BEHIND_WINDOW
from kiln.runtime.graph_runner import GraphRunner
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf, tokens
from tests.models.test_gemma2_gemma3 import VARIANTS

NEW_TOKENS = 60
PROMPT = [1, *range(40, 70)]  # 31 tokens: four windows
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ARGS = dict(block_size=4, kv_cache_memory_gb=0.01, max_num_seqs=8, device="cpu")


def _hf_generate(model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model_type, hf_class, overrides = VARIANTS["gemma3"]
    path = str(tmp_path_factory.mktemp("gemma3") / "src")
    model = save_tiny_hf(path, model_type, hf_class, perturb=perturb_norms_and_biases, **overrides)
    model.generation_config.eos_token_id = None
    return path, model, _hf_generate(model, PROMPT, NEW_TOKENS)


def test_windowed_groups_stay_bounded_while_the_full_group_grows(gemma3) -> None:
    path, _, want = gemma3
    llm = LLM(path, max_num_batched_tokens=8, **ARGS)  # the prompt in chunks of 8
    engine, kv = llm.engine, llm.engine.kv_cache
    engine.add_request(PROMPT, PARAMS, request_id="a")
    held: list[list[int]] = []  # per step: blocks the request holds in each group
    while engine.has_unfinished_requests():
        engine.step()
        if any("a" in g.req_to_blocks for g in kv.groups):
            held.append(
                [sum(b is not BEHIND_WINDOW for b in g.req_to_blocks["a"]) for g in kv.groups]
            )
    assert tokens([engine.finished_output("a")]) == [want]
    full = [h[0] for h in held]
    windowed = [max(h[1:]) for h in held]
    # The full group holds the whole context: 31 + 60 tokens (the last one never written).
    assert full == sorted(full) and full[-1] == -(-(len(PROMPT) + NEW_TOKENS - 1) // 4)
    # A window of 7 reads at most 3 blocks of 4; a chunk of 8 adds 2, a decode 1.
    assert max(windowed) <= 5 and max(windowed[len(PROMPT) // 8 + 1 :]) <= 3
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_decode_graphs_read_each_groups_table(gemma3) -> None:
    path, model, want = gemma3
    prompts = [PROMPT, PROMPT[:9], [1, *range(200, 220)]]
    wants = [want, *(_hf_generate(model, p, NEW_TOKENS) for p in prompts[1:])]
    llm = LLM(path, max_num_batched_tokens=64, **ARGS)
    runner = llm.engine.executor.runner
    runner.graphs = GraphRunner(
        runner.model,
        runner.ops,
        runner.backend,
        runner.kv_caches,
        runner.inputs,
        runner.max_num_seqs,
        runner.max_model_len,
        fake=True,
    )
    runner.graphs.capture()
    runner.step_timing = {}
    assert tokens(llm.generate(prompts, PARAMS)) == wants
    assert runner.step_timing["graph_steps"] > 0


def test_next_turn_hits_after_the_windows_gave_blocks_back(gemma3) -> None:
    path, model, want = gemma3
    # A pool just big enough: the first turn's windowed blocks are reused on the way.
    llm = LLM(path, max_num_batched_tokens=8, **{**ARGS, "num_kv_blocks": 40})
    assert tokens(llm.generate([PROMPT], PARAMS)) == [want]
    turn = [*PROMPT, *want, 5, 6, 7]
    out = llm.generate([turn], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    # The full group's blocks of the whole first turn and the windows before the new tokens.
    assert out.num_cached_tokens > len(PROMPT)
    assert out.outputs[0].token_ids == _hf_generate(model, turn, 8)
