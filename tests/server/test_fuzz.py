"""Property-based fuzzing of every endpoint from the server's own /openapi.json (schemathesis):
whatever the body, valid or not, the answer is never a 5xx and the engine loop survives."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kiln.server.app import build_app
from tests.server_harness import MODEL_NAME, ServerThread, shared_engine

pytestmark = pytest.mark.timeout(600)

# Generation length is not what is fuzzed here: cap it so each example takes well under a second.
_MAX_TOKENS, _MAX_N, _MAX_PROMPTS = 4, 2, 4


@pytest.fixture(scope="module")
def server():
    with ServerThread(build_app(shared_engine(), MODEL_NAME)) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _keep_short(case) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    for key, cap in (
        ("max_tokens", _MAX_TOKENS),
        ("max_completion_tokens", _MAX_TOKENS),
        ("max_output_tokens", _MAX_TOKENS),
    ):
        if _is_int(body.get(key)) and body[key] > cap:
            body[key] = cap
    for key in ("n", "best_of"):  # best_of: a beam search's width
        if _is_int(body.get(key)) and body[key] > _MAX_N:
            body[key] = _MAX_N
    # An explicit null (or no limit on chat) means "up to the context", as in vLLM: on the CPU up
    # to the whole context for each of four prompts, which once outlasted the client's timeout.
    if case.path == "/v1/completions" and "max_tokens" in body and body["max_tokens"] is None:
        body["max_tokens"] = _MAX_TOKENS
    no_limit = body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    if case.path == "/v1/chat/completions" and no_limit:
        body["max_completion_tokens"] = _MAX_TOKENS
    if case.path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = _MAX_TOKENS
    if isinstance(body.get("prompt"), list):
        body["prompt"] = body["prompt"][:_MAX_PROMPTS]


POST = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/tokenize",
    "/detokenize",
]
GET = ["/v1/models", "/health", "/version", "/metrics"]
CASES = [(p, "POST", mode) for p in POST for mode in ("positive", "negative")]
CASES += [(p, "GET", "positive") for p in GET]


@pytest.mark.parametrize("path, method, mode", CASES)
def test_no_server_errors(api_schema, path, method, mode):
    operation = api_schema[path][method]
    strategy = operation.as_strategy(generation_mode=GenerationMode(mode))

    @given(case=strategy)
    @settings(
        max_examples=40 if method == "POST" else 3,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        _keep_short(case)
        response = case.call(timeout=120)
        assert response.status_code < 500, f"{method} {path} {case.body!r} -> {response.text[:500]}"

    check()


def test_engine_survived_the_fuzzing(server):
    assert shared_engine().healthy
    assert httpx.get(server.base_url + "/health").status_code == 200
