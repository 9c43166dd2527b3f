"""Multi-LoRA serving against Hugging Face + PEFT (fp32, CPU): greedy tokens per adapter alone
and in one batch mixing three adapters and the base, after an unload and reload, with more
adapters in use than slots, with decode graphs (FakeGraph) padding the batch; and the prefix
cache never shared across adapters."""

from __future__ import annotations

import pytest

from kiln import LLM, LoRAError, LoRARequest, SamplingParams
from kiln.runtime.graph_runner import GraphRunner
from tests.lora.adapters import SPECS, build_adapter, build_base, hf_greedy

PROMPTS = [[1, 5, 9, 33, 70, 12], [1, *range(40, 61)], [1, 200, 3, 4]]
MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Setup:
    """A base model, three adapters of SPECS, their LoRARequests and HF's tokens for each
    (None: the base) and prompt."""

    def __init__(self, variant: str, root) -> None:
        self.path = str(root / "base")
        base = build_base(variant, self.path)
        self.requests: list[LoRARequest | None] = [None]
        self.expected: dict[int | None, list[list[int]]] = {
            None: [hf_greedy(base, p, MAX_TOKENS) for p in PROMPTS]
        }
        for i, spec in enumerate(SPECS, start=1):
            path = str(root / spec.name)
            peft_model = build_adapter(base, spec, path, seed=i)
            self.requests.append(LoRARequest(spec.name, i, path))
            self.expected[i] = [hf_greedy(peft_model, p, MAX_TOKENS) for p in PROMPTS]
        for i in range(1, len(SPECS) + 1):  # the adapters do change the outputs
            assert self.expected[i] != self.expected[None]


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-bias"])
def setup(request, tmp_path_factory) -> Setup:
    return Setup(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def llm(setup: Setup) -> LLM:
    return LLM(setup.path, enable_lora=True, max_loras=3, max_lora_rank=8, max_num_seqs=16)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _id(lora: LoRARequest | None) -> int | None:
    return None if lora is None else lora.lora_int_id


def test_each_adapter_alone_matches_hf(setup: Setup, llm: LLM) -> None:
    for lora in setup.requests:
        got = _tokens(llm.generate(PROMPTS, PARAMS, lora_request=lora))
        assert got == setup.expected[_id(lora)], lora


def test_three_adapters_and_the_base_in_one_batch(setup: Setup, llm: LLM) -> None:
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for lora in setup.requests:
            prompts.append(prompt)
            loras.append(lora)
            expected.append(setup.expected[_id(lora)][i])
    assert _tokens(llm.generate(prompts, PARAMS, lora_request=loras)) == expected
    assert llm.engine.list_loras() == {1, 2, 3}


def test_unload_and_reload(setup: Setup, llm: LLM) -> None:
    engine = llm.engine
    lora = setup.requests[2]
    assert lora is not None
    llm.generate(PROMPTS[:1], PARAMS, lora_request=lora)
    assert engine.remove_lora(lora.lora_int_id)
    assert not engine.remove_lora(lora.lora_int_id)  # gone already
    assert lora.lora_int_id not in engine.list_loras()
    # A request naming it by path loads it again; add_lora of a loaded id is a no-op.
    assert _tokens(llm.generate(PROMPTS, PARAMS, lora_request=lora)) == setup.expected[2]
    assert not engine.add_lora(lora)
    assert engine.remove_lora(lora.lora_int_id) and engine.add_lora(lora)
    mixed = [setup.requests[3], lora, None]
    got = _tokens(llm.generate(PROMPTS, PARAMS, lora_request=mixed))
    assert got == [setup.expected[_id(r)][i] for i, r in enumerate(mixed)]


def test_an_adapter_in_use_is_not_removed(setup: Setup, llm: LLM) -> None:
    lora = setup.requests[1]
    assert lora is not None
    req_id = llm.engine.add_request(PROMPTS[0], PARAMS, lora_request=lora)
    with pytest.raises(LoRAError, match="in use"):
        llm.engine.remove_lora(lora.lora_int_id)
    llm.engine.abort_request(req_id)
    assert llm.engine.remove_lora(lora.lora_int_id)
    llm.engine.add_lora(lora)


def test_more_adapters_than_slots(setup: Setup) -> None:
    """One slot, three adapters and the base over many requests: each adapter waits for the
    slot, evicted least recently used; no step mixes two adapters; tokens unchanged."""
    llm = LLM(setup.path, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_seqs=16)
    scheduler = llm.engine.scheduler
    schedule, per_step = scheduler.schedule, []

    def recording():
        out = schedule()
        ids = {scheduler.requests[r].lora_int_id for r in out.num_scheduled_tokens}
        per_step.append(ids - {None})
        return out

    scheduler.schedule = recording
    loras = [setup.requests[1 + (i % 3)] for i in range(6)] + [None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    got = _tokens(llm.generate(prompts, PARAMS, lora_request=loras))
    assert got == [setup.expected[_id(r)][i % len(PROMPTS)] for i, r in enumerate(loras)]
    assert max(len(ids) for ids in per_step) == 1
    assert len({frozenset(ids) for ids in per_step if ids}) == 3  # each adapter had its turn


def test_decode_graphs_pad_with_no_adapter(setup: Setup) -> None:
    """FakeGraph decode steps (a batch of 3 padded to 4) read each step's slots from the
    persistent buffer the graphs captured; steps without an adapter replay the set captured
    without the LoRA kernels."""
    llm = LLM(setup.path, enable_lora=True, max_loras=3, max_lora_rank=8, max_num_seqs=8)
    runner = llm.engine.executor.runner
    runner.graphs = GraphRunner(
        runner.model, runner.ops, runner.backend, runner.kv_caches, runner.inputs,
        runner.max_num_seqs, runner.max_model_len, fake=True, lora_inputs=runner.lora.inputs,
    )  # fmt: skip
    runner.graphs.capture()
    assert runner.graphs.base_graphs.keys() == runner.graphs.graphs.keys()
    replays = {"lora": 0, "base": 0}
    for name, graphs in (("lora", runner.graphs.graphs), ("base", runner.graphs.base_graphs)):
        for graph, _ in graphs.values():
            graph.replay = _counted(graph.replay, replays, name)
    runner.step_timing = {}
    loras = [setup.requests[1], None, setup.requests[3]]  # 3 decodes: padded to 4
    got = _tokens(llm.generate(PROMPTS, PARAMS, lora_request=loras))
    assert got == [setup.expected[_id(r)][i] for i, r in enumerate(loras)]
    assert runner.step_timing["graph_steps"] > 0
    assert replays["lora"] > 0 and replays["base"] == 0
    assert _tokens(llm.generate(PROMPTS, PARAMS)) == setup.expected[None]
    assert replays["base"] > 0


def _counted(replay, counts: dict, name: str):
    def counting() -> None:
        counts[name] += 1
        replay()

    return counting


def test_prefix_cache_is_keyed_by_adapter(setup: Setup, llm: LLM) -> None:
    prompt = [1, *range(100, 140)]  # two full blocks of 16 to share
    one = SamplingParams(temperature=0, max_tokens=1)
    a, b = setup.requests[1], setup.requests[2]

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate([prompt], one, lora_request=lora)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0  # the same prompt under another adapter: no hit
    assert cached(None) == 0  # nor under the base
    assert cached(b) == 32  # under the same adapter: a hit
    assert cached(a) == 32


def test_fp8_base(setup: Setup) -> None:
    """Over FP8 W8A8 weights the LoRA-targeted projections run unfused: the base's requests
    keep the plain FP8 engine's tokens, and an adapter's its own (HF has no FP8 oracle: its
    layer-level check is tests/lora/test_layers.py)."""
    llm = LLM(setup.path, quantization="fp8-dynamic", enable_lora=True, max_lora_rank=8)
    plain = LLM(setup.path, quantization="fp8-dynamic")
    assert _tokens(llm.generate(PROMPTS, PARAMS)) == _tokens(plain.generate(PROMPTS, PARAMS))
    lora = setup.requests[1]
    mixed = _tokens(llm.generate(PROMPTS, PARAMS, lora_request=[lora, None, lora]))
    alone = _tokens(llm.generate(PROMPTS, PARAMS, lora_request=lora))
    assert (
        mixed[0] == alone[0]
        and mixed[2] == alone[2]
        and alone != _tokens(plain.generate(PROMPTS, PARAMS))
    )


def test_chunked_and_preempted(setup: Setup) -> None:
    """Prompts prefilled in chunks of 8 tokens and a KV pool too small for every request at
    once (preemption, then a recompute that takes its adapter's slot again): tokens unchanged."""
    llm = LLM(
        setup.path, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=16,
        max_num_batched_tokens=8, num_kv_blocks=9, block_size=4,
    )  # fmt: skip
    loras = [setup.requests[1 + i % 3] for i in range(5)] + [None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    got = _tokens(llm.generate(prompts, PARAMS, lora_request=loras))
    assert got == [setup.expected[_id(r)][i % len(PROMPTS)] for i, r in enumerate(loras)]
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_folded_kv_cache_scales(setup: Setup) -> None:
    """KV-cache scales folded into the k, v and o_proj weights (a float8 cache's calibrated
    scales; here in fp32, where attention is unchanged by them): the adapters' k, v and o
    outputs are scaled alike, so the tokens stay HF + PEFT's."""
    from kiln.models.kv_scales import fold_kv_scales

    llm = LLM(setup.path, enable_lora=True, max_loras=3, max_lora_rank=8)
    model = llm.engine.executor.runner.model
    fold_kv_scales(model, [(2.0, 0.25)] * len(model.layers))
    loras = setup.requests[1:]
    got = _tokens(llm.generate(PROMPTS, PARAMS, lora_request=loras))
    assert got == [setup.expected[_id(r)][i] for i, r in enumerate(loras)]


def test_granite_multipliers(tmp_path) -> None:
    """Granite folds its residual multiplier into o_proj and down_proj as they load: the
    adapters' outputs there are scaled alike."""
    import torch
    import transformers

    from tests.conftest import TINY_BASE
    from tests.lora.adapters import ALL_SEVEN, AdapterSpec

    config = transformers.GraniteConfig(
        **TINY_BASE, residual_multiplier=0.5, embedding_multiplier=2.0,
        attention_multiplier=0.2, logits_scaling=4.0,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.GraniteForCausalLM(config).eval()
    base.save_pretrained(tmp_path / "base")
    peft_model = build_adapter(base, AdapterSpec("g", 4, 8, ALL_SEVEN), str(tmp_path / "g"), 1)
    expected = [hf_greedy(peft_model, p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(str(tmp_path / "base"), enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("g", 1, str(tmp_path / "g"))
    assert _tokens(llm.generate(PROMPTS, PARAMS, lora_request=lora)) == expected
