"""LoRA under tensor and pipeline parallelism (gloo, processes on this machine): the same greedy
tokens as HF + PEFT, three adapters and the base in one batch, each rank holding its cut of
each adapter (column-parallel B rows, row-parallel A columns); adapters added and removed on
every rank."""

from __future__ import annotations

import pytest

from kiln import LLM, LoRAError, LoRARequest
from tests.lora.test_lora_vs_hf import MAX_TOKENS, PARAMS, PROMPTS, Setup, _id, _tokens

COMMON = dict(dtype="float32", num_threads=1, distributed_timeout_s=60, device="cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup("llama-gqa", tmp_path_factory.mktemp("lora-parallel"))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_lora_equals_hf(setup: Setup, tp: int, pp: int) -> None:
    llm = LLM(
        setup.path, enable_lora=True, max_loras=2, max_lora_rank=8,
        tensor_parallel_size=tp, pipeline_parallel_size=pp, **COMMON,
    )  # fmt: skip
    try:
        prompts, loras, expected = [], [], []
        for i, prompt in enumerate(PROMPTS):
            for lora in setup.requests:
                prompts.append(prompt)
                loras.append(lora)
                expected.append(setup.expected[_id(lora)][i])
        assert _tokens(llm.generate(prompts, PARAMS, lora_request=loras)) == expected
        lora = setup.requests[2]
        assert lora is not None and llm.engine.remove_lora(lora.lora_int_id)
        with pytest.raises(LoRAError, match="no such directory"):
            llm.engine.add_lora(LoRARequest("gone", 9, setup.path + "/nowhere"))
        got = _tokens(llm.generate(PROMPTS, PARAMS, lora_request=lora))  # read again
        assert got == setup.expected[2] and len(got[0]) == MAX_TOKENS
    finally:
        llm.shutdown()
