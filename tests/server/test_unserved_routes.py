"""OpenAI routes kiln does not serve answer one line that says why (404, code not_supported),
not a bare "Not Found": the openai SDK shows the message as it is."""

from __future__ import annotations

import pytest

from tests.conftest import build_tiny_hf_model
from tests.lazy_import import lazy_import
from tests.server_harness import ServerThread

openai = lazy_import("openai")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kiln.config import EngineConfig
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.llm_engine import LLMEngine
    from kiln.server.app import build_app

    path = str(tmp_path_factory.mktemp("tiny"))
    build_tiny_hf_model("llama-gqa", path)
    config = EngineConfig(model=path, max_model_len=64, kv_cache_memory_gb=0.01, max_num_seqs=2)
    with ServerThread(build_app(AsyncEngine(LLMEngine(config)), "tiny")) as srv:
        yield srv


def test_embeddings_are_refused_in_one_line(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.NotFoundError) as exc:
        client.embeddings.create(model="tiny", input="hello")
    error = exc.value.body
    assert error["code"] == "not_supported"
    assert error["message"] == (
        "/v1/embeddings is not served: kiln serves generation only: no embeddings (vLLM's "
        "--task embed)"
    )
