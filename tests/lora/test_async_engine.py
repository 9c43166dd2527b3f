"""The server's engine loop takes a request's adapter: the same tokens as LLM.generate, and a
bad adapter refused at submit (before any byte streams) while the loop serves on."""

from __future__ import annotations

import asyncio

import pytest

from kiln import LLM, LoRAError, LoRARequest, SamplingParams
from kiln.engine.async_engine import AsyncEngine
from tests.lora.adapters import ALL_SEVEN, AdapterSpec, build_adapter, build_base

PROMPT = [1, 5, 9, 33, 70, 12]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_async_engine_serves_adapters(tmp_path):
    base = build_base("llama-gqa", str(tmp_path / "base"))
    build_adapter(base, AdapterSpec("a", 4, 8, ALL_SEVEN), str(tmp_path / "a"), seed=1)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    llm = LLM(str(tmp_path / "base"), enable_lora=True)
    expected = llm.generate([PROMPT], PARAMS, lora_request=lora)[0].outputs[0].token_ids
    engine = AsyncEngine(llm.engine)

    async def run(req_id: str, adapter: LoRARequest | None) -> list[int]:
        tokens: list[int] = []
        async for delta in engine.generate(PROMPT, PARAMS, req_id, lora_request=adapter):
            tokens += delta.outputs[0].token_ids
        return tokens

    try:
        assert asyncio.run(run("r1", lora)) == expected
        with pytest.raises(LoRAError, match="no such directory"):
            asyncio.run(run("r2", LoRARequest("gone", 2, str(tmp_path / "gone"))))
        assert asyncio.run(run("r3", lora)) == expected

        async def loras() -> set[int]:
            return await engine.call(lambda e: e.list_loras())

        assert asyncio.run(loras()) == {1}
    finally:
        engine.shutdown()
