"""`kiln serve --enable-lora`: a request's `model` naming an adapter runs with it (the same
greedy text as the offline API with that LoRARequest, whose tokens are HF + PEFT's), the base
model's name runs without, an unknown name is a 404; /v1/models lists the adapters; vLLM's
load/unload endpoints add and drop them at run time, behind the API key, a bad adapter a 400
after which the server keeps serving. One tiny random chat Llama and one server per module."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kiln import LoRARequest, SamplingParams
from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.server.lora_modules import LoRAModule
from tests.lazy_import import lazy_import
from tests.peft_adapters import ALL_LINEAR, ATTENTION, hf_greedy, save_adapter
from tests.server_harness import ServerThread, offline
from tests.tiny_tokenizer import build_tiny_chat_model

openai = lazy_import("openai")

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
KEY = "sk-lora"
MAX_TOKENS = 8
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The base model and its adapters: sql (attention, rank 4), chat (all seven, rank 8),
    wide (rank 16, over the server's limit) and the token prompt they are compared on."""
    root = tmp_path_factory.mktemp("lora-serving")
    base = build_tiny_chat_model(str(root / "base"))
    sql = save_adapter(base, str(root / "sql"), ATTENTION, rank=4, alpha=8, seed=1, scale=4.0)
    chat = save_adapter(base, str(root / "chat"), ALL_LINEAR, rank=8, alpha=8, seed=2, scale=4.0)
    save_adapter(base, str(root / "wide"), ["q_proj"], rank=16, seed=3)
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(base).encode("the quick brown fox")
    want = {
        "sql": hf_greedy(sql, [prompt], MAX_TOKENS)[0],
        "chat": hf_greedy(chat, [prompt], MAX_TOKENS)[0],
    }
    return {"root": root, "base": base, "prompt": prompt, "hf": want}


@pytest.fixture(scope="module")
def engine(files):
    config = EngineConfig(
        model=files["base"],
        max_model_len=256,
        kv_cache_memory_gb=0.05,
        max_num_seqs=8,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    engine = AsyncEngine(LLMEngine(config))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine, files):
    """Started with `--lora-modules sql=...` (loaded as kiln serve loads them)."""
    from kiln.server.app import build_app
    from kiln.server.lora import load_modules

    app = build_app(engine, MODEL, api_key=KEY)
    sql = LoRAModule("sql", str(files["root"] / "sql"), base_model_name="tiny-base")
    asyncio.run(load_modules(app.state.kiln, (sql,)))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _offline(engine, files, lora: LoRARequest | None) -> tuple[str, list[int]]:
    """The offline API's greedy text and tokens on the server's own engine."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    out = offline(engine, lambda llm: llm.generate([files["prompt"]], params, lora_request=lora))
    return out[0].outputs[0].text, list(out[0].outputs[0].token_ids)


def _complete(http: httpx.Client, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return http.post("/v1/completions", json={**body, "ignore_eos": True})


def _load(http: httpx.Client, name: str, path: str) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_a_request_naming_an_adapter_runs_with_it(server, http, client, engine, files):
    """sql (from --lora-modules, id 1): the offline API's text with the same LoRARequest, whose
    tokens are HF + PEFT's; the base model's name gives the base's, which differs."""
    sql = LoRARequest("sql", 1, str(files["root"] / "sql"))
    sql_text, sql_tokens = _offline(engine, files, sql)
    base_text, base_tokens = _offline(engine, files, None)
    assert sql_tokens == files["hf"]["sql"] and base_tokens != sql_tokens

    got = _complete(http, "sql", files["prompt"]).json()
    assert got["model"] == "sql" and got["choices"][0]["text"] == sql_text
    assert _complete(http, MODEL, files["prompt"]).json()["choices"][0]["text"] == base_text

    via_sdk = client.completions.create(
        model="sql", prompt=files["prompt"], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert via_sdk.model == "sql" and via_sdk.choices[0].text == sql_text
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt=files["prompt"], max_tokens=2)
    assert info.value.code == "model_not_found" and "`tiny`, `sql`" in info.value.message


def test_chat_responses_and_messages_route_by_model(http, files):
    ask = [{"role": "user", "content": "hi"}]
    replies = {}
    for model in ("sql", MODEL):
        chat = http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": ask, "max_tokens": 6, "temperature": 0},
        ).json()
        assert chat["model"] == model
        replies[model] = chat["choices"][0]["message"]["content"]
        response = http.post(
            "/v1/responses",
            json={"model": model, "input": ask, "max_output_tokens": 6, "temperature": 0},
        ).json()
        assert response["model"] == model
        assert response["output"][-1]["content"][0]["text"] == replies[model]
        message = http.post(
            "/v1/messages",
            json={"model": model, "messages": ask, "max_tokens": 6, "temperature": 0},
        ).json()
        assert message["model"] == model and message["content"][0]["text"] == replies[model]
    assert replies["sql"] != replies[MODEL]
    stream = http.post(
        "/v1/chat/completions",
        json={"model": "sql", "messages": ask, "max_tokens": 6, "temperature": 0, "stream": True},
    )
    chunks = [json.loads(x[6:]) for x in stream.text.splitlines() if x.startswith("data: {")]
    assert {c["model"] for c in chunks} == {"sql"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == replies["sql"]


def test_models_lists_the_adapters(client, http):
    models = {m.id: m for m in client.models.list().data}
    assert list(models)[:2] == [MODEL, "sql"]
    sql = models["sql"].model_dump()
    assert sql["parent"] == "tiny-base" and sql["root"].endswith("sql")
    assert client.models.retrieve("sql").id == "sql"
    metrics = http.get("/metrics").text
    (line,) = [x for x in metrics.splitlines() if x.startswith("kiln:lora_adapters_info{")]
    assert 'adapters="sql' in line and 'max_lora="2"' in line
    assert 'kiln:lora_requests_info{max_lora="2",running_lora_adapters=""' in metrics


def test_load_and_unload_at_run_time(server, http, engine, files):
    """A loaded adapter serves at once under the next id; unloading it frees the name (a
    404 after), and loading it again gives it a new id."""
    chat_path = str(files["root"] / "chat")
    response = _load(http, "chat", chat_path)
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'chat' added successfully."
    text, tokens = _offline(engine, files, LoRARequest("chat", 2, chat_path))
    assert tokens == files["hf"]["chat"]
    assert _complete(http, "chat", files["prompt"]).json()["choices"][0]["text"] == text
    assert "chat" in [m["id"] for m in http.get("/v1/models").json()["data"]]

    again = _load(http, "chat", chat_path)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert gone.status_code == 200 and "removed successfully" in gone.text
    assert _complete(http, "chat", files["prompt"]).status_code == 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 404
    assert _load(http, "chat", chat_path).status_code == 200
    assert 2 not in asyncio.run(_ids(engine)) and asyncio.run(_ids(engine)) >= {1}
    assert _complete(http, "chat", files["prompt"]).json()["choices"][0]["text"] == text


async def _ids(engine: AsyncEngine) -> set[int]:
    return await engine.list_loras()


def test_requests_of_several_adapters_at_once(http, engine, files):
    """sql, chat and the base in flight together: each gets its own answer."""
    want = {}
    for model in ("sql", "chat", MODEL):
        want[model] = _complete(http, model, files["prompt"]).json()["choices"][0]["text"]
    models = ["sql", "chat", MODEL] * 3
    with ThreadPoolExecutor(len(models)) as pool:
        got = list(pool.map(lambda m: _complete(http, m, files["prompt"]).json(), models))
    assert [g["choices"][0]["text"] for g in got] == [want[m] for m in models]


def test_an_adapter_in_use_is_not_unloaded(http, files):
    """Unloading while a request runs with it is a 400; it stays served and unloads after."""
    _load(http, "busy", str(files["root"] / "sql"))
    body = {"model": "busy", "prompt": files["prompt"], "max_tokens": 200, "stream": True}
    with http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as stream:
        lines = stream.iter_lines()
        assert next(x for x in lines if x.startswith("data: {"))  # it runs
        refused = http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
        assert refused.status_code == 400 and "in use" in refused.json()["error"]["message"]
        deadline = time.monotonic() + 10  # vLLM's gauge names it (from the engine's snapshot)
        while 'running_lora_adapters="busy"' not in http.get("/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert "busy" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    deadline = time.monotonic() + 30  # the closed stream's abort reaches the engine
    while (
        gone := http.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
    ).status_code != 200:
        assert time.monotonic() < deadline, gone.text
        time.sleep(0.1)


def test_with_several_api_processes_the_run_time_routes_are_refused(engine):
    from kiln.server.app import build_app

    with ServerThread(build_app(engine, MODEL, lora_runtime_updates=False)) as srv:
        body = {"lora_name": "x", "lora_path": "/x"}
        response = httpx.post(srv.base_url + "/v1/load_lora_adapter", json=body)
        assert response.status_code == 400 and "--api-server-count" in response.text


def _bad_adapters(root, base: str) -> dict[str, tuple[str, str]]:
    """name -> (path, what the 400 says)."""
    missing = str(root / "missing-weights")
    shutil.copytree(root / "sql", missing)
    os.remove(os.path.join(missing, "adapter_model.safetensors"))
    renamed = str(root / "renamed")
    shutil.copytree(root / "sql", renamed)
    from safetensors.torch import load_file, save_file

    file = os.path.join(renamed, "adapter_model.safetensors")
    save_file({k.replace("q_proj", "fc9"): v for k, v in load_file(file).items()}, file)
    narrow = str(root / "narrow")
    shutil.copytree(root / "sql", narrow)
    file = os.path.join(narrow, "adapter_model.safetensors")
    save_file({k: v[:, :8].contiguous() if "lora_A" in k else v
               for k, v in load_file(file).items()}, file)  # fmt: skip
    return {
        "no-dir": (str(root / "no-such-adapter"), "no-such-adapter"),
        "no-weights": (missing, "adapter_model"),
        "too-wide": (str(root / "wide"), "rank"),
        "no-module": (renamed, "fc9"),
        "wrong-shape": (narrow, "shape"),
    }


def test_a_bad_adapter_is_a_400_and_the_server_keeps_serving(http, files):
    for name, (path, says) in _bad_adapters(files["root"], files["base"]).items():
        response = _load(http, name, path)
        assert response.status_code == 400, (name, response.text)
        message = response.json()["error"]["message"]
        assert "\n" not in message and says in message, (name, message)
        assert name not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert http.get("/health").status_code == 200
    assert _complete(http, "sql", files["prompt"]).status_code == 200


def test_the_lora_routes_are_behind_the_api_key(server, files):
    path = str(files["root"] / "chat")
    body = {"lora_name": "x", "lora_path": path}
    assert httpx.post(server.base_url + "/v1/load_lora_adapter", json=body).status_code == 401
    unload = httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert unload.status_code == 401


def test_without_enable_lora_the_routes_say_so():
    from kiln.server.app import build_app
    from tests.server_harness import tiny_chat_engine

    with ServerThread(build_app(tiny_chat_engine(), MODEL)) as srv:
        body = {"lora_name": "x", "lora_path": "/x"}
        response = httpx.post(srv.base_url + "/v1/load_lora_adapter", json=body)
        assert response.status_code == 404 and "--enable-lora" in response.text
        models = httpx.get(srv.base_url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [MODEL]


def _serve(files, port: int, *lora_flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln.cli.main", "serve", files["base"], "--port", str(port)]
    cmd += ["--served-model-name", MODEL, "--api-key", KEY, "--log-level", "warning"]
    cmd += ["--kv-cache-memory-gb", "0.05", "--max-num-seqs", "4", "--max-model-len", "256"]
    cmd += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", *lora_flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kiln_serve_with_the_engine_process(http, files):
    """The command line, the adapters crossing to the engine process and back: the same
    answers as the in-process server's; a bad --lora-modules stops start-up in one line."""
    from tests.server.test_lifecycle import _wait_healthy
    from tests.server_harness import free_port

    sql, chat = str(files["root"] / "sql"), str(files["root"] / "chat")
    bad = _serve(files, free_port(), "--lora-modules", f"broken={files['root'] / 'nowhere'}")
    port = free_port()
    proc = _serve(files, port, "--lora-modules", f"sql={sql}")
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, base)
        with httpx.Client(base_url=base, headers=HEADERS, timeout=120) as remote:
            for model in ("sql", MODEL):
                want = _complete(http, model, files["prompt"]).json()["choices"][0]["text"]
                got = _complete(remote, model, files["prompt"]).json()["choices"][0]["text"]
                assert got == want, model
            assert _load(remote, "chat", chat).status_code == 200
            _load(http, "chat", chat)  # on the in-process server too (200, or loaded before)
            want = _complete(http, "chat", files["prompt"]).json()["choices"][0]["text"]
            assert _complete(remote, "chat", files["prompt"]).json()["choices"][0]["text"] == want
            wide = _load(remote, "wide", str(files["root"] / "wide"))
            assert wide.status_code == 400 and "rank" in wide.json()["error"]["message"]
            assert _load(remote, "chat", chat).status_code == 400
            gone = remote.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
            assert gone.status_code == 200
            assert _complete(remote, "chat", files["prompt"]).status_code == 404
            assert _complete(remote, "sql", files["prompt"]).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    out, _ = bad.communicate(timeout=120)
    assert bad.returncode == 2, out
    (line,) = [x for x in out.splitlines() if x.startswith("error:")]
    assert line.startswith("error: --lora-modules broken=") and "nowhere" in line
