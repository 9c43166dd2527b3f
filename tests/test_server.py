"""`kiln serve` through the official openai client and raw HTTP, on the embedded SmolLM2:
outputs equal the offline API's, concurrency, disconnects, errors, auth, limits, metrics.

One engine serves every test here (server_harness.shared_engine); reference outputs come from
the offline `LLM` API run on that same engine between requests.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_harness import MODEL_NAME, ServerThread, offline, shared_engine

from kiln import SamplingParams
from kiln.server.app import build_app

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


def _wait_until_idle(http: httpx.Client, since: float, within_s: float = 1.0) -> None:
    while metric(http, "kv_cache_usage_perc") > 0 or metric(http, "num_requests_running") > 0:
        assert time.monotonic() - since < within_s, "KV blocks not freed within a second"
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
        assert c.get("/metrics").status_code == 401
        good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1).choices
        bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


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
