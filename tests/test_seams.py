"""The extension seams work with today's code: a linear method that only says how to apply
itself, logits processors in the sampler, several tokens per request per step, the executor."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.request import Request
from kiln.engine.scheduler import Scheduler
from kiln.interfaces import ModelRunnerOutput
from kiln.kv_cache.manager import KVCacheManager
from kiln.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from kiln.sampling import LogitsProcessor, MinTokensProcessor, Sampler
from tests.conftest import build_tiny_hf_model
from tests.sampling.test_sampler import make_metadata


@pytest.fixture(scope="module")
def tiny_qwen_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    build_tiny_hf_model("qwen2-bias", path)
    return path


class _ComposedMethod(LinearMethod):
    """Unquantized weights, but only `apply`: every fused entry point takes the base class's
    composition (norm, then apply, then rotary/KV write or SiLU-mul), as a new scheme would."""

    calls = 0

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        UnquantizedLinearMethod().create_weights(layer, dtype)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        _ComposedMethod.calls += 1
        return ops.linear(x, layer.weight, layer.bias)


def test_a_method_with_only_apply_matches_the_fused_path(tiny_qwen_path) -> None:
    prompts = [[1, 5, 9, 30, 77, 3], [1, *range(40, 70)]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    want = LLM(tiny_qwen_path).generate(prompts, params)
    llm = LLM(tiny_qwen_path)
    for module in llm.engine.executor.runner.model.modules():
        if isinstance(module, Linear):
            module.method = _ComposedMethod()
    _ComposedMethod.calls = 0
    got = llm.generate(prompts, params)
    assert _ComposedMethod.calls > 0  # the swapped method really ran
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-5 for t in pa)


def test_fused_shards_load_into_their_rows(tiny_qwen_path) -> None:
    """q, k and v (weights and biases) land in their rows of qkv_proj, in that order."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen_path)
    layer = LLM(tiny_qwen_path).engine.executor.runner.model.layers[1].self_attn.qkv_proj
    ref = hf.model.layers[1].self_attn
    for ours, names in ((layer.weight, "weight"), (layer.bias, "bias")):
        q, k, v = (getattr(getattr(ref, f"{p}_proj"), names) for p in "qkv")
        assert torch.equal(ours.cpu(), torch.cat([q, k, v]).to(ours.dtype))
    assert layer.output_sizes == [q.shape[0], k.shape[0], v.shape[0]]


class _BanToken(LogitsProcessor):
    def __init__(self, token_id: int, preserves_argmax: bool) -> None:
        self.token_id, self.preserves_argmax = token_id, preserves_argmax

    def is_active(self, metadata) -> bool:
        return True

    def apply(self, logits: torch.Tensor, metadata) -> torch.Tensor:
        logits = logits.clone()
        logits[:, self.token_id] = float("-inf")
        return logits


def test_logits_processors_run_in_order_and_gate_the_greedy_fast_path() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    greedy = make_metadata(1, temperature=0.0)
    # One that may change the argmax sends the batch down the full path, where it applies.
    assert Sampler(processors=[_BanToken(1, False)])(logits, greedy).sampled_token_ids.item() == 2
    # In order: after banning 1 then 2, the best left is 3.
    banned = [_BanToken(1, False), _BanToken(2, False)]
    assert Sampler(processors=banned)(logits, greedy).sampled_token_ids.item() == 3
    # A processor that claims to preserve the argmax is skipped by the fast path (its claim is
    # the contract: this one lies, so the lie shows).
    assert Sampler(processors=[_BanToken(1, True)])(logits, greedy).sampled_token_ids.item() == 1
    assert isinstance(Sampler().processors[0], MinTokensProcessor)  # min_tokens is the first


def _scheduler_with(prompt: list[int], params: SamplingParams) -> tuple[Scheduler, Request]:
    scheduler = Scheduler(KVCacheManager(16, 4), 4, 64, max_model_len=64)
    request = Request("r", prompt, params, eos_token_ids=(2,), max_tokens=params.max_tokens)
    scheduler.add_request(request)
    return scheduler, request


def test_several_tokens_per_step_stop_at_the_first_stop() -> None:
    """A step that returns several tokens for a request (verified drafts) appends them in order
    and stops at the first stop condition; the tokens after it are dropped."""
    scheduler, request = _scheduler_with([1, 5, 6], SamplingParams(max_tokens=10))
    step = scheduler.schedule()
    outputs = scheduler.update(step, ModelRunnerOutput({"r": [7, 8, 2, 9]}))
    assert outputs[0].new_token_ids == [7, 8, 2] and outputs[0].finish_reason == "stop"
    assert request.output_token_ids == [7, 8, 2]
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache.pool.num_free_blocks == 16


def test_several_tokens_per_step_respect_max_tokens() -> None:
    scheduler, _ = _scheduler_with([1, 5, 6], SamplingParams(max_tokens=2))
    outputs = scheduler.update(scheduler.schedule(), ModelRunnerOutput({"r": [7, 8, 9]}))
    assert outputs[0].new_token_ids == [7, 8] and outputs[0].finish_reason == "length"


def test_several_tokens_per_step_keep_going() -> None:
    scheduler, request = _scheduler_with([1, 5, 6], SamplingParams(max_tokens=10))
    outputs = scheduler.update(scheduler.schedule(), ModelRunnerOutput({"r": [7, 8]}))
    assert outputs[0].new_token_ids == [7, 8] and outputs[0].finish_reason is None
    assert request.num_tokens == 5 and request.num_output_placeholders == 0
    step = scheduler.schedule()  # the next step computes the tokens not yet in the cache
    assert step.num_scheduled_tokens == {"r": 2}


def test_executor_stats_report_the_plan(smollm2_llm) -> None:
    stats = smollm2_llm.engine.executor.stats()
    capacity = smollm2_llm.engine.executor.kv_capacity()
    assert (
        stats.memory_plan.num_blocks
        == capacity.num_blocks
        == smollm2_llm.engine.kv_cache.pool.num_blocks
    )
    assert stats.cuda_graphs is None  # CPU: eager steps
    assert smollm2_llm.engine.executor.facts.kv_cache_dtype == "float32"
