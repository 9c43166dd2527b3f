"""`kiln serve` through the official openai client and raw HTTP, on the embedded SmolLM2:
outputs equal the offline API's, concurrency, disconnects, errors, auth, limits, metrics.

One engine serves every test here (server_harness.shared_engine); reference outputs come from
the offline `LLM` API run on that same engine between requests.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest

from kiln import SamplingParams
from kiln.server.app import build_app
from tests.lazy_import import lazy_import
from tests.server_harness import MODEL_NAME, ServerThread, offline, shared_engine

openai = lazy_import("openai")

pytestmark = pytest.mark.timeout(300)  # the first test also waits for the model to load

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine():
    return shared_engine()


@pytest.fixture(scope="module")
def server(engine):
    app = build_app(engine, MODEL_NAME, max_body_bytes=1 << 20)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(f"kiln:{name}{{") or line.startswith(f"kiln:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


# ---- equality with the offline API ---------------------------------------------------------


def test_completions_equal_offline(engine, client):
    params = SamplingParams(temperature=0, max_tokens=12)
    outs = offline(engine, lambda llm: [o.outputs[0] for o in llm.generate(PROMPTS, params)])
    ref = [o.text for o in outs]
    # One request with a list of prompts: choices in prompt order.
    batch = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0
    )
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == ref
    assert batch.usage.completion_tokens == sum(len(o.token_ids) for o in outs)
    for prompt, expected in zip(PROMPTS, ref):
        stream = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_token_id_prompts_equal_text_prompts(engine, client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPTS[0]


def test_chat_equals_offline(engine, client):
    params = SamplingParams(temperature=0, max_tokens=12)
    out = offline(engine, lambda llm: llm.chat(CHAT, params)[0].outputs[0])
    ref = out.text
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == ref
    assert reply.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[-1].usage.completion_tokens == len(out.token_ids) == reply.usage.completion_tokens


def test_n_seed_and_stop_equal_offline(engine, client):
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10, stop=["."])
    ref = offline(engine, lambda llm: [o.text for o in llm.generate(PROMPTS[0], params)[0].outputs])
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], n=3, temperature=0.8, seed=7, max_tokens=10, stop="."
    )
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == ref
    assert all("." not in text for text in ref)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        n=3,
        temperature=0.8,
        seed=7,
        max_tokens=10,
        stop=".",
        stream=True,
    )
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == ref
    chat_params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=8)
    chat_ref = offline(engine, lambda llm: [o.text for o in llm.chat(CHAT, chat_params)[0].outputs])
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, n=2, temperature=0.8, seed=3, max_tokens=8
    )
    assert [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)] == chat_ref


def test_logprobs_equal_offline(engine, client):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    out = offline(engine, lambda llm: llm.generate(PROMPTS[1], params)[0].outputs[0])
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(
        [p[t].logprob for t, p in zip(out.token_ids, out.logprobs)]
    )
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    # Greedy: each chosen token is the most likely one.
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


def test_echo_prompt_logprobs_for_lm_eval(engine, http):
    """lm-evaluation-harness `local-completions` loglikelihood: token-id prompts, echo, logprobs,
    max_tokens 0 (older harness) or 1 (newer, which drops the last entry)."""
    ids = http.post("/tokenize", json={"prompt": "The capital of France is Paris"}).json()["tokens"]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    ref = offline(engine, lambda llm: llm.generate(ids, params)[0].prompt_logprobs)
    for max_tokens in (0, 1):
        body = {"prompt": [ids], "max_tokens": max_tokens, "echo": True, "logprobs": 1}
        reply = http.post("/v1/completions", json={**body, "temperature": 0, "seed": 1234})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = [pos[t].logprob for t, pos in zip(ids[1:], ref[1:])]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(expected)
        assert choice["text"].startswith("The capital of France is Paris")
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        # What the harness computes: continuation logprob and whether it is greedy.
        ctx = len(ids) - 1
        cont = lp["token_logprobs"][ctx : len(ids)]
        greedy = all(t == max(top.values()) for t, top in zip(cont, lp["top_logprobs"][ctx:]))
        assert sum(cont) < 0 and isinstance(greedy, bool)
    stream = http.post(
        "/v1/completions",
        json={"prompt": "Hi there", "max_tokens": 0, "echo": True, "stream": True},
    )
    assert "Hi there" in stream.text and stream.text.rstrip().endswith("data: [DONE]")


def test_prompt_logprobs_extra_on_completions(engine, http):
    """vLLM's prompt_logprobs: per prompt token, {id: {logprob, rank, decoded_token}}, equal to
    the offline API's; null for the first token. Streamed once, in the first chunk."""
    ids = http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    ref = offline(engine, lambda llm: llm.generate(ids, params)[0].prompt_logprobs)
    body = {"prompt": [ids], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for token_id, ours, theirs in zip(ids[1:], got[1:], ref[1:]):
        assert str(token_id) in ours and len(ours) <= 3
        assert ours[str(token_id)]["logprob"] == pytest.approx(theirs[token_id].logprob)
        assert {e["rank"] for e in ours.values()} >= {1, 2}
    stream = http.post("/v1/completions", json={**body, "stream": True}).text
    assert stream.count('"prompt_logprobs"') == 1
    plain = http.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]


def test_chat_continue_final_message_and_echo(engine, client, http):
    """vLLM's chat extras: the reply continues the assistant's last message (the template gets
    continue_final_message, no generation prompt), and echo prepends that message's text."""
    partial = [*CHAT, {"role": "assistant", "content": "The capital of France"}]
    body = {"model": MODEL_NAME, "messages": partial, "max_tokens": 6, "temperature": 0}
    body.update(add_generation_prompt=False, continue_final_message=True)
    reply = http.post("/v1/chat/completions", json=body).json()
    tokenizer = engine.engine.tokenizer
    prompt = tokenizer.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    ref = offline(
        engine,
        lambda llm: (
            llm.generate(
                tokenizer.encode(prompt, add_special_tokens=False),
                SamplingParams(temperature=0, max_tokens=6),
            )[0]
            .outputs[0]
            .text
        ),
    )
    assert reply["choices"][0]["message"]["content"] == ref
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "The capital of France" + ref
    stream = http.post("/v1/chat/completions", json={**body, "echo": True, "stream": True})
    assert '"content":"The capital of France"' in stream.text.replace(": ", ":")
    both = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


# ---- load, disconnects ---------------------------------------------------------------------


def test_64_concurrent_streams_equal_alone(engine, server):
    """64 streams at once; each equals the same request served alone (greedy and seeded)."""
    combos = []
    for i in range(16):
        prompt = f"Story number {i}: once upon a time"
        kwargs = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": i}
        combos.append((prompt, kwargs))
    alone = offline(
        engine,
        lambda llm: [
            llm.generate(p, SamplingParams(max_tokens=8, **kw))[0].outputs[0].text
            for p, kw in combos
        ],
    )

    async def one(aclient: openai.AsyncOpenAI, prompt: str, kwargs: dict) -> str:
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, stream=True, **kwargs
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="-", max_retries=0, timeout=240
        )
        async with aclient:
            jobs = [one(aclient, p, kw) for _ in range(4) for p, kw in combos]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert len(results) == 64
    assert results == alone * 4


def _wait_until_idle(http: httpx.Client, since: float, within_s: float = 15.0) -> None:
    # /metrics answers at once from the engine's last step (it used to wait for the step in
    # progress): the aborts show once that step ends, and a CPU step under load takes seconds.
    while metric(http, "kv_cache_usage_perc") > 0 or metric(http, "num_requests_running") > 0:
        assert time.monotonic() - since < within_s, f"KV blocks not freed within {within_s}s"
        time.sleep(0.05)


def test_disconnect_aborts_and_frees_kv(server, http):
    body = {"prompt": "Count forever:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    generated_before = metric(http, "generation_tokens_total")

    async def open_and_drop() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as ac:

            async def one() -> None:
                async with ac.stream("POST", "/v1/completions", json=body) as response:
                    seen = 0
                    async for line in response.aiter_lines():
                        seen += line.startswith("data:")
                        if seen >= 3:
                            return  # leaving the block closes the connection mid-stream

            await asyncio.gather(*(one() for _ in range(16)))

    asyncio.run(open_and_drop())
    _wait_until_idle(http, since=time.monotonic())
    # Aborted, not run to the end unobserved: far fewer than 16 x 400 tokens were generated.
    assert metric(http, "generation_tokens_total") - generated_before < 16 * 100
    reply = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"]


def test_non_streaming_disconnect_aborts(server, http):
    body = {"prompt": "Count forever:", "max_tokens": 400, "ignore_eos": True}

    async def give_up() -> list:
        timeout = httpx.Timeout(120, read=1.0)  # the client hangs up after a second
        async with httpx.AsyncClient(base_url=server.base_url, timeout=timeout) as ac:
            posts = (ac.post("/v1/completions", json=body) for _ in range(4))
            return await asyncio.gather(*posts, return_exceptions=True)

    replies = asyncio.run(give_up())
    assert all(isinstance(r, httpx.ReadTimeout) for r in replies), replies
    _wait_until_idle(http, since=time.monotonic())


def test_waiting_queue_is_bounded(engine):
    app = build_app(engine, MODEL_NAME, max_waiting=2)
    body = {"prompt": "Tell me a long story", "max_tokens": 4}
    with ServerThread(app) as srv:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as ac:
                return await asyncio.gather(
                    *(ac.post("/v1/completions", json=body) for _ in range(12))
                )

        replies = asyncio.run(burst())
    codes = sorted(r.status_code for r in replies)
    assert set(codes) <= {200, 503} and 200 in codes and 503 in codes
    refused = next(r for r in replies if r.status_code == 503).json()["error"]
    assert refused["code"] == "server_overloaded" and "retry" in refused["message"]


# ---- errors, auth, limits --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [10**12]]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 3}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_invalid_values_are_400_with_param(http, path, body, param):
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]


def test_malformed_json_is_400(http):
    reply = http.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400 and "error" in reply.json()


def test_too_long_prompt_is_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[5] * 600, max_tokens=4)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    long_chat = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=long_chat, max_tokens=4)
    assert info.value.code == "context_length_exceeded"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)


def test_oversized_body_is_413(http):
    huge = {"prompt": "x" * (2 << 20), "max_tokens": 1}
    reply = http.post("/v1/completions", json=huge)
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert http.get("/health").status_code == 200  # and the server carries on


def test_api_key(engine):
    app = build_app(engine, MODEL_NAME, api_key="s3cret")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        body = {"prompt": "Hi", "max_tokens": 1}
        assert c.get("/health").status_code == 200  # probes need no key
        assert c.post("/v1/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer s3cres"}
        reply = c.post("/v1/completions", json=body, headers=wrong)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        # Only /metrics is open beside /health (as vLLM's: a scrape set up for vLLM sends no key);
        # kiln keeps its other routes behind the key.
        assert c.get("/metrics").status_code == 200
        for path in ("/tokenize", "/detokenize"):
            assert c.post(path, json={"prompt": "Hi", "tokens": [1]}).status_code == 401
        for path in ("/version", "/tokenizer_info", "/v1/models/x", "/nonexistent"):
            assert c.get(path).status_code == 401, path
        good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1).choices
        bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_metrics_api_key_guards_only_metrics(engine):
    app = build_app(engine, MODEL_NAME, metrics_api_key="scrape")
    with ServerThread(app) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert c.get("/metrics").status_code == 401
        wrong = c.get("/metrics", headers={"Authorization": "Bearer other"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = c.get("/metrics", headers={"Authorization": "Bearer scrape"})
        assert ok.status_code == 200 and "num_requests_running" in ok.text
        assert c.get("/v1/models").status_code == 200  # no --api-key: the rest is open


# ---- small endpoints, metrics ----------------------------------------------------------------


def test_models_health_version(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    chat_ids = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat_ids["count"] == len(chat_ids["tokens"]) > 5
    assert http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_models_retrieve_and_tokenizer_info(client, http):
    """The openai SDK's models.retrieve, and what lm-eval's remote tokenizer reads."""
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert info["model_max_length"] == http.get("/v1/models").json()["data"][0]["max_model_len"]


def test_created_is_each_responses_own(client):
    """Not the server's start time: a response made a second later says so."""
    started = time.time()  # the module's server started before this
    time.sleep(1.1)
    reply = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
    assert reply.created > started and chat.created > started
    assert client.models.list().data[0].created > started


def test_metrics_carry_vllm_names(http):
    http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    text = http.get("/metrics").text
    for name in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "prefix_cache_hit_rate",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "request_success_total",
    ):
        assert f"kiln:{name}" in text, name
    assert metric(http, "generation_tokens_total") >= 3
    assert 'finished_reason="length"' in text


def test_bench_serve_client(server):
    """`kiln bench serve` against this server: every request completes, every token is timed."""
    import argparse

    from kiln.bench.serve_client import run_serve_bench

    args = argparse.Namespace(
        base_url=server.base_url,
        api_key=None,
        vocab_size=None,
        concurrency=2,
        num_requests=4,
        input_len="16",
        output_len="4",
        dataset_seed=0,
        warmup=0,
        request_rate=float("inf"),
        output_json=None,
    )
    record = run_serve_bench(args)
    report = record["kiln"]
    assert record["num_failed"] == 0 and report["num_requests"] == 4
    assert report["output_tokens"] == 16 and report["input_tokens"] == 64
    assert report["ttft"]["p50_ms"] > 0 and report["itl"]["p99_ms"] > 0


# ---- metrics under vLLM's names: vLLM's own Grafana dashboard ------------------------------

DASHBOARD_QUERIES = Path(__file__).parents[1] / "data" / "vllm_dashboard_queries.txt"


def scrape(base_url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/metrics as {sample name: [(labels, value)]}, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=60).text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v for got, v in samples.get(name, []) if all(got.get(k) == x for k, x in labels.items())
    )


@pytest.fixture(scope="module")
def vllm_server(engine):
    with ServerThread(build_app(engine, MODEL_NAME, metrics_prefix="vllm")) as srv:
        yield srv


def test_vllm_dashboard_queries_find_their_series(vllm_server):
    """Each expr of vLLM's Grafana dashboard, evaluated structurally: every metric it names is
    scraped, with model_name="$model_name" matching ours and the labels it groups by."""
    httpx.post(
        vllm_server.base_url + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 3},
        timeout=60,
    )
    samples = scrape(vllm_server.base_url)
    lines = DASHBOARD_QUERIES.read_text().splitlines()
    queries = [q for q in lines if q.strip() and not q.startswith("#")]
    assert len(queries) > 20
    for query in queries:
        query = query.replace("$model_name", MODEL_NAME)
        by = ",".join(re.findall(r"by\s*\(([^)]*)\)", query))
        grouped = {label.strip() for label in by.split(",")} - {""}
        selectors = re.findall(r"(vllm:[A-Za-z0-9_:]+)(?:\{([^}]*)\})?", query)
        assert selectors, query
        for name, matchers in selectors:
            assert name in samples, f"{name} (from {query})"
            wanted = dict(re.findall(r'(\w+)="([^"]*)"', matchers))
            series = [labels for labels, _ in samples[name] if wanted.items() <= labels.items()]
            assert series, f"no {name} series with {wanted}"
            assert all(grouped <= set(labels) for labels in series), (name, grouped)
    # Not only names: the quantile panels have cumulative buckets up to +Inf.
    buckets = samples["vllm:e2e_request_latency_seconds_bucket"]
    counts = [v for _, v in sorted(buckets, key=lambda lv: float(lv[0]["le"]))]
    assert counts == sorted(counts) and counts[-1] >= 1
    assert not any(name.startswith("kiln:") for name in samples)
    assert "process_resident_memory_bytes" in samples  # the process collector, unprefixed
    assert "python_gc_objects_collected_total" in samples


def test_vllm_only_metrics_and_cache_config_info(engine, vllm_server):
    samples = scrape(vllm_server.base_url)
    (info, value), *_ = samples["vllm:cache_config_info"]
    kv = engine.engine.kv_cache
    assert value == 1 and info["block_size"] == str(kv.block_size)
    assert info["num_gpu_blocks"] == str(kv.pool.num_blocks) and info["cache_dtype"]
    assert info["enable_prefix_caching"] in ("True", "False")
    for name in (
        "request_prompt_tokens_bucket",
        "request_generation_tokens_bucket",
        "request_prefill_time_seconds_bucket",
        "request_decode_time_seconds_bucket",
        "request_inference_time_seconds_bucket",
        "iteration_tokens_total_bucket",
        "request_params_n_bucket",
        "request_params_max_tokens_bucket",
        "time_per_output_token_seconds_bucket",
        "gpu_cache_usage_perc",
    ):
        assert all("model_name" in labels for labels, _ in samples[f"vllm:{name}"]), name
    # vLLM's bucket boundaries: 1-2-5 up to max_model_len (512) for token counts.
    les = [labels["le"] for labels, _ in samples["vllm:request_prompt_tokens_bucket"]]
    assert les == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "+Inf"]
    les = [labels["le"] for labels, _ in samples["vllm:iteration_tokens_total_bucket"]]
    assert les[:3] == ["1.0", "8.0", "16.0"] and les[-2:] == ["16384.0", "+Inf"]


def test_histograms_count_finished_requests(vllm_server):
    """Per finished completion (each of n counts): request_success, the latency and token-count
    histograms; per accepted prompt: the request_params ones."""
    names = [
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
        "request_inference_time_seconds_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
    ]
    before = scrape(vllm_server.base_url)
    url = vllm_server.base_url + "/v1/completions"
    body = {"max_tokens": 5, "ignore_eos": True, "temperature": 0}
    one = httpx.post(url, json={**body, "prompt": "Hello"}, timeout=60).json()
    two = httpx.post(url, json={**body, "prompt": ["Hi", "Yo"], "n": 2}, timeout=60).json()
    after = scrape(vllm_server.base_url)

    def delta(name: str, **labels: str) -> float:
        return total(after, f"vllm:{name}", **labels) - total(before, f"vllm:{name}", **labels)

    assert delta("request_success_total") == 5
    assert delta("request_success_total", finished_reason="length") == 5
    for name in names:
        assert delta(name) == 5, name
    generated = one["usage"]["completion_tokens"] + two["usage"]["completion_tokens"]
    assert delta("request_generation_tokens_sum") == generated == 25
    prompt_tokens = one["usage"]["prompt_tokens"] + two["usage"]["prompt_tokens"]
    assert delta("prompt_tokens_total") == prompt_tokens
    assert delta("request_params_n_count") == 3 and delta("request_params_n_sum") == 5
    assert delta("request_params_max_tokens_sum") == 15
    assert delta("request_max_num_generation_tokens_count") == 3
    # Every token the engine produced went through some step; ITL under both names.
    assert delta("iteration_tokens_total_count") >= 5
    assert delta("iteration_tokens_total_sum") >= generated
    itl = delta("inter_token_latency_seconds_count")
    assert delta("time_per_output_token_seconds_count") == itl
    assert 0 < itl <= generated - 5  # one per later delta: none for a completion's first token


def test_disconnects_count_as_aborted(vllm_server):
    body = {"prompt": "Count forever:", "max_tokens": 400, "ignore_eos": True}
    abort = {"finished_reason": "abort"}
    before = total(scrape(vllm_server.base_url), "vllm:request_success_total", **abort)

    async def drop_both() -> None:
        timeout = httpx.Timeout(120, read=1.0)  # the non-streaming client hangs up after 1 s
        async with httpx.AsyncClient(base_url=vllm_server.base_url, timeout=timeout) as ac:

            async def streaming() -> None:
                # Its own read timeout: its first token may take more than a second on a busy
                # CPU, and the 1 s one is the non-streaming client's way of hanging up.
                request = dict(json={**body, "stream": True}, timeout=httpx.Timeout(120))
                async with ac.stream("POST", "/v1/completions", **request) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            return  # leaving the block closes the connection mid-stream

            async def plain() -> None:
                with pytest.raises(httpx.ReadTimeout):
                    await ac.post("/v1/completions", json=body)

            await asyncio.gather(streaming(), plain())

    asyncio.run(drop_both())
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(vllm_server.base_url)
        aborted = total(samples, "vllm:request_success_total", **abort) - before
        # /metrics reads the engine's last-step snapshot: the running gauge can lag the aborts.
        idle = total(samples, "vllm:num_requests_running") == 0
        if (aborted >= 2 and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert aborted == 2
    assert total(samples, "vllm:num_requests_running") == 0


def test_metrics_prefix_both_exports_each_metric_twice(engine):
    with ServerThread(build_app(engine, MODEL_NAME, metrics_prefix="both")) as srv:
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        samples = scrape(srv.base_url)
    kiln = {name.removeprefix("kiln:") for name in samples if name.startswith("kiln:")}
    vllm = {name.removeprefix("vllm:") for name in samples if name.startswith("vllm:")}
    assert kiln == vllm and len(kiln) > 40
    for name in kiln:
        assert len(samples[f"kiln:{name}"]) == len(samples[f"vllm:{name}"]), name
    assert len(samples["process_resident_memory_bytes"]) == 1  # unprefixed, once
    with pytest.raises(ValueError, match="metrics_prefix"):
        build_app(engine, MODEL_NAME, metrics_prefix="tgi")


def test_server_side_abort_counts_as_aborted(engine):
    """What the drain deadline does (engine.abort of each in-flight request): the stream ends with
    finish_reason "abort", counted in request_success and, having ended, in the histograms."""
    app = build_app(engine, MODEL_NAME, metrics_prefix="vllm")
    in_flight = app.state.kiln.lifecycle.in_flight
    body = {"prompt": "Count forever:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with ServerThread(app) as srv:
        before = scrape(srv.base_url)
        reasons = []
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and not reasons:
                    reasons.append(None)
                    for req_id in set(in_flight):
                        engine.abort(req_id)
                if '"finish_reason":"abort"' in line.replace(" ", ""):
                    reasons.append("abort")
        after = scrape(srv.base_url)
    assert reasons[-1] == "abort"

    def delta(name: str, **labels: str) -> float:
        return total(after, f"vllm:{name}", **labels) - total(before, f"vllm:{name}", **labels)

    assert delta("request_success_total", finished_reason="abort") == 1
    assert delta("e2e_request_latency_seconds_count") == 1
    assert delta("request_decode_time_seconds_count") == 1


def test_max_tokens_default_caps_requests_that_name_none(engine):
    """A client that forgets max_tokens would run to the context (vLLM's default); a server
    started with --max-tokens-default bounds it, and an explicit max_tokens still wins."""
    app = build_app(engine, MODEL_NAME, max_tokens_default=3)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        chat = {"model": MODEL_NAME, "messages": CHAT, "temperature": 0, "ignore_eos": True}
        assert c.post("/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"] == 3
        more = c.post("/v1/chat/completions", json={**chat, "max_tokens": 5}).json()
        assert more["usage"]["completion_tokens"] == 5
        body = {"prompt": "Hi", "max_tokens": None, "ignore_eos": True}
        assert c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
