"""KServe v2 / Triton's protocol on `kiln serve`, through the real tritonclient (HTTP and gRPC,
streaming included) and raw HTTP, on the shared embedded SmolLM2: greedy tokens equal
/v1/completions' and the offline API's; bad tensors get the protocol's error (400 /
INVALID_ARGUMENT), never a 500; the server keeps serving after them.
"""

from __future__ import annotations

import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln import SamplingParams
from kiln.server.app import build_app
from tests.server_harness import MODEL_NAME, ServerThread, offline, shared_engine

pytestmark = pytest.mark.timeout(300)  # the first test also waits for the model to load

PROMPT = "The capital of France is"
MAX_TOKENS = 6


def _serve(engine, **kwargs) -> ServerThread:
    app = build_app(engine, MODEL_NAME, grpc_port=0, **kwargs)
    srv = ServerThread(app)
    srv.server.config.lifespan = "on"  # the lifespan serves gRPC; the harness turns it off
    srv.app = app
    return srv


@pytest.fixture(scope="module")
def engine():
    return shared_engine()


@pytest.fixture(scope="module")
def server(engine):
    with _serve(engine) as srv:
        srv.grpc_url = f"127.0.0.1:{srv.app.state.grpc_port}"
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tc_http(server):
    client = httpclient.InferenceServerClient(server.base_url.removeprefix("http://"))
    yield client
    client.close()


@pytest.fixture(scope="module")
def tc_grpc(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def ref(engine, http):
    """Greedy reference: /v1/completions' text, the offline API's token ids, the prompt ids."""
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    reply = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    ).json()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    out = offline(engine, lambda llm: llm.generate(PROMPT, params)[0].outputs[0])
    assert out.text == reply["choices"][0]["text"]
    logprobs = [pos[t].logprob for t, pos in zip(out.token_ids, out.logprobs)]
    return {"text": out.text, "ids": out.token_ids, "prompt_ids": ids, "logprobs": logprobs}


def _token_inputs(mod, prompt_ids, **extra) -> list:
    """tensorrt_llm's inputs for one row, as Triton users build them."""
    arrays = {
        "input_ids": np.array([prompt_ids], dtype=np.int32),
        "input_lengths": np.array([[len(prompt_ids)]], dtype=np.int32),
        "request_output_len": np.array([[MAX_TOKENS]], dtype=np.int32),
        **extra,
    }
    return _inputs(mod, arrays)


def _inputs(mod, arrays: dict, binary: bool = True) -> list:
    inputs = []
    for name, arr in arrays.items():
        dtype = "BYTES" if arr.dtype == object else _np_to_triton(arr.dtype)
        t = mod.InferInput(name, list(arr.shape), dtype)
        if mod is httpclient:
            t.set_data_from_numpy(arr, binary_data=binary)
        else:
            t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def _np_to_triton(dtype) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(dtype)


def _text_inputs(mod, prompt: str, **extra) -> list:
    return _inputs(
        mod,
        {
            "text_input": np.array([[prompt.encode()]], dtype=object),
            "max_tokens": np.array([[MAX_TOKENS]], dtype=np.int32),
            **extra,
        },
    )


def _stream(client, model: str, inputs: list, outputs: list | None = None) -> list:
    """Every response of one decoupled request over ModelStreamInfer, up to the final flag."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, outputs=outputs, enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=120)
            if error is not None:
                raise error
            responses.append(result)
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return responses
    finally:
        client.stop_stream()


# ---- health, metadata, config --------------------------------------------------------------


def test_health_metadata_and_config(tc_http, tc_grpc, http):
    for client in (tc_http, tc_grpc):
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("tensorrt_llm") and client.is_model_ready("ensemble")
        assert not client.is_model_ready("no_such_model")
    meta = tc_http.get_model_metadata("tensorrt_llm")
    names = {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]}
    assert names["input_ids"] == ("INT32", [-1, -1])
    assert names["input_lengths"] == ("INT32", [-1, 1])
    assert {"end_id", "pad_id", "stop_words_list", "bad_words_list", "random_seed"} <= set(names)
    assert {t["name"] for t in meta["outputs"]} >= {
        "output_ids",
        "sequence_length",
        "cum_log_probs",
        "output_log_probs",
    }
    gmeta = tc_grpc.get_model_metadata("ensemble")
    assert gmeta.name == "ensemble" and "text_input" in [t.name for t in gmeta.inputs]
    config = tc_http.get_model_config("ensemble")
    assert config["max_batch_size"] >= 1 and config["model_transaction_policy"]["decoupled"]
    gconfig = tc_grpc.get_model_config("tensorrt_llm").config
    assert gconfig.name == "tensorrt_llm" and gconfig.model_transaction_policy.decoupled
    assert [i.name for i in gconfig.input][:3] == [
        "input_ids",
        "input_lengths",
        "request_output_len",
    ]
    assert tc_grpc.get_server_metadata().name == "kiln"
    assert "generate" in tc_http.get_server_metadata()["extensions"]
    assert http.get("/v2/models/nope").status_code == 404
    assert "error" in http.get("/v2/models/nope/config").json()
    with pytest.raises(InferenceServerException, match="unknown model"):
        tc_grpc.get_model_metadata("nope")


# ---- equality with /v1/completions ---------------------------------------------------------


def test_tensorrt_llm_http_equals_completions(tc_http, http, ref):
    exclude = np.array([[True]], dtype=bool)
    for binary in (True, False):
        outputs = [
            httpclient.InferRequestedOutput(name, binary_data=binary)
            for name in ("output_ids", "sequence_length", "cum_log_probs", "output_log_probs")
        ]
        result = tc_http.infer(
            "tensorrt_llm",
            _token_inputs(httpclient, ref["prompt_ids"], exclude_input_in_output=exclude),
            outputs=outputs,
        )
        n = int(result.as_numpy("sequence_length")[0, 0])
        ids = result.as_numpy("output_ids")[0, 0, :n].tolist()
        assert ids == ref["ids"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == ref["text"]
        assert result.as_numpy("output_log_probs")[0, 0].tolist() == pytest.approx(
            ref["logprobs"], abs=1e-4
        )
        assert result.as_numpy("cum_log_probs")[0, 0] == pytest.approx(
            sum(ref["logprobs"]), abs=1e-3
        )
    # The backend's default (exclude_input_in_output false): the prompt, then the completion.
    result = tc_http.infer("tensorrt_llm", _token_inputs(httpclient, ref["prompt_ids"]))
    assert result.as_numpy("output_ids")[0, 0].tolist() == ref["prompt_ids"] + ref["ids"]


def test_tensorrt_llm_batch_rows_equal_alone(tc_http, http, ref):
    """Two rows of different lengths in one request: each as it is alone, padded with pad_id."""
    other = http.post("/tokenize", json={"prompt": "1, 2, 3,"}).json()["tokens"]
    alone = tc_http.infer(
        "tensorrt_llm",
        _token_inputs(httpclient, other, exclude_input_in_output=np.array([[True]])),
    ).as_numpy("output_ids")[0, 0]
    width = max(len(other), len(ref["prompt_ids"]))
    pad = lambda ids: ids + [0] * (width - len(ids))
    arrays = {
        "input_ids": np.array([pad(ref["prompt_ids"]), pad(other)], dtype=np.int32),
        "input_lengths": np.array([[len(ref["prompt_ids"])], [len(other)]], dtype=np.int32),
        "request_output_len": np.array([[MAX_TOKENS], [MAX_TOKENS]], dtype=np.int32),
        "exclude_input_in_output": np.array([[True], [True]]),
        "pad_id": np.array([[-7], [-7]], dtype=np.int32),
    }
    result = tc_http.infer("tensorrt_llm", _inputs(httpclient, arrays))
    lengths = result.as_numpy("sequence_length")[:, 0].tolist()
    ids = result.as_numpy("output_ids")
    assert ids[0, 0, : lengths[0]].tolist() == ref["ids"]
    assert ids[1, 0, : lengths[1]].tolist() == alone.tolist()
    assert all(t == -7 for t in ids[int(np.argmin(lengths)), 0, min(lengths) :])


def test_tensorrt_llm_grpc_and_stream_equal_completions(tc_grpc, ref):
    exclude = np.array([[True]], dtype=bool)
    result = tc_grpc.infer(
        "tensorrt_llm",
        _token_inputs(grpcclient, ref["prompt_ids"], exclude_input_in_output=exclude),
    )
    assert result.as_numpy("output_ids")[0, 0].tolist() == ref["ids"]
    assert result.as_numpy("sequence_length").tolist() == [[len(ref["ids"])]]
    # Decoupled streaming: one response per token, then the final flag.
    streaming = np.array([[True]], dtype=bool)
    responses = _stream(
        tc_grpc, "tensorrt_llm", _token_inputs(grpcclient, ref["prompt_ids"], streaming=streaming)
    )
    streamed = [t for r in responses for t in r.as_numpy("output_ids")[0, 0].tolist()]
    assert streamed == ref["ids"]
    assert len(responses) >= len(ref["ids"])
    # streaming=true over unary ModelInfer is the protocol's error, not a silent single answer.
    with pytest.raises(InferenceServerException, match="ModelStreamInfer") as err:
        tc_grpc.infer(
            "tensorrt_llm", _token_inputs(grpcclient, ref["prompt_ids"], streaming=streaming)
        )
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_ensemble_equals_completions(server, tc_grpc, http, ref):
    """Every text path at once (the engine batches them; each must equal the request alone)."""
    exclude = np.array([[True]], dtype=bool)
    body = {"text_input": PROMPT, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True}

    def tc_http_infer(exclude_input: bool) -> str:
        client = httpclient.InferenceServerClient(server.base_url.removeprefix("http://"))
        try:
            extra = {"exclude_input_in_output": exclude} if exclude_input else {}
            result = client.infer("ensemble", _text_inputs(httpclient, PROMPT, **extra))
            return result.as_numpy("text_output")[0, 0].decode()
        finally:
            client.close()

    def tc_grpc_infer() -> str:
        result = tc_grpc.infer(
            "ensemble", _text_inputs(grpcclient, PROMPT, exclude_input_in_output=exclude)
        )
        return result.as_numpy("text_output")[0, 0].decode()

    def tc_grpc_stream() -> str:
        client = grpcclient.InferenceServerClient(server.grpc_url)  # one stream per client
        try:
            inputs = _text_inputs(grpcclient, PROMPT, stream=np.array([[True]]))
            responses = _stream(client, "ensemble", inputs)
        finally:
            client.close()
        assert len(responses) >= 2
        return "".join(r.as_numpy("text_output")[0, 0].decode() for r in responses)

    def generate() -> str:
        reply = http.post("/v2/models/ensemble/generate", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model_name"] == "ensemble"
        return reply.json()["text_output"]

    def generate_stream() -> str:
        stream_body = {**body, "parameters": {"stream": True}}
        with http.stream("POST", "/v2/models/ensemble/generate_stream", json=stream_body) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        return "".join(e["text_output"] for e in events)

    def generate_ids() -> list[int]:
        reply = http.post(
            "/v2/models/tensorrt_llm/generate",
            json={
                "input_ids": ref["prompt_ids"],
                "input_lengths": len(ref["prompt_ids"]),
                "request_output_len": MAX_TOKENS,
                "exclude_input_in_output": True,
            },
        )
        return reply.json()["output_ids"]

    jobs = {
        "http": lambda: tc_http_infer(True),
        "http, with the input": lambda: tc_http_infer(False),
        "grpc": tc_grpc_infer,
        "grpc stream": tc_grpc_stream,
        "generate": generate,
        "generate_stream": generate_stream,
        "generate ids": generate_ids,
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        got = {name: f.result(timeout=240) for name, f in futures.items()}
    expected = {name: ref["text"] for name in jobs}
    expected["http, with the input"] = PROMPT + ref["text"]  # the backend's default
    expected["generate ids"] = ref["ids"]
    assert got == expected


# ---- the protocol's errors -----------------------------------------------------------------


def _infer_body(**overrides) -> dict:
    inputs = {
        "input_ids": {"name": "input_ids", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]},
        "input_lengths": {
            "name": "input_lengths",
            "datatype": "INT32",
            "shape": [1, 1],
            "data": [3],
        },
        "request_output_len": {
            "name": "request_output_len",
            "datatype": "INT32",
            "shape": [1, 1],
            "data": [2],
        },
    }
    for name, value in overrides.items():
        if value is None:
            inputs.pop(name)
        else:
            inputs[name] = {"name": name, **value}
    return {"inputs": list(inputs.values())}


BAD_TENSORS = {
    "wrong dtype": _infer_body(input_ids={"datatype": "INT64", "shape": [1, 3], "data": [1, 2, 3]}),
    "wrong shape": _infer_body(input_ids={"datatype": "INT32", "shape": [3], "data": [1, 2, 3]}),
    "missing input": _infer_body(request_output_len=None),
    "unknown input": _infer_body(draft_logits={"datatype": "FP32", "shape": [1, 1], "data": [0.5]}),
    "count != shape": _infer_body(input_ids={"datatype": "INT32", "shape": [1, 4], "data": [1, 2]}),
    "float in INT32": _infer_body(
        input_ids={"datatype": "INT32", "shape": [1, 3], "data": [1, 2.5, 3]}
    ),
    "id past vocab": _infer_body(
        input_ids={"datatype": "INT32", "shape": [1, 3], "data": [1, 2, 10**9]}
    ),
    "length > ids": _infer_body(input_lengths={"datatype": "INT32", "shape": [1, 1], "data": [9]}),
    "zero output len": _infer_body(
        request_output_len={"datatype": "INT32", "shape": [1, 1], "data": [0]}
    ),
    "bad_words_list": _infer_body(
        bad_words_list={"datatype": "INT32", "shape": [1, 2, 1], "data": [5, 1]}
    ),
    "beam search": _infer_body(beam_width={"datatype": "INT32", "shape": [1, 1], "data": [4]}),
    "batch mismatch": _infer_body(
        input_lengths={"datatype": "INT32", "shape": [2, 1], "data": [3, 3]}
    ),
    "unknown output": {**_infer_body(), "outputs": [{"name": "generation_logits"}]},
    "unknown parameter": {**_infer_body(), "parameters": {"sequence_id": 3}},
    "classification": {
        **_infer_body(),
        "outputs": [{"name": "output_ids", "parameters": {"classification": 3}}],
    },
    # Issue 57: the limits the OpenAI routes have (each was a 500 or accepted before).
    "100k dims": _infer_body(
        input_ids={"datatype": "INT32", "shape": [1, 1] + [1] * 100_000, "data": [1]}
    ),
    "max_tokens past the context": _infer_body(
        request_output_len={"datatype": "INT32", "shape": [1, 1], "data": [2**31 - 1]}
    ),
    "NaN temperature": _infer_body(
        temperature={"datatype": "FP32", "shape": [1, 1], "data": [float("nan")]}
    ),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_bad_tensors_get_400_over_http(http, case):
    body = json.dumps(BAD_TENSORS[case]).encode()  # NaN as JSON's NaN, which httpx refuses
    reply = http.post("/v2/models/tensorrt_llm/infer", content=body)
    assert reply.status_code == 400, reply.text
    assert isinstance(reply.json()["error"], str) and reply.json()["error"]
    if case == "beam search":  # kiln has beam search: the refusal says where it is
        assert "use_beam_search" in reply.json()["error"], reply.text


def test_deeply_nested_data_gets_400(http):
    depth = 50_000
    data = "[" * depth + "1" + "]" * depth
    body = json.dumps(_infer_body()).replace('"data": [1, 2, 3]', f'"data": {data}', 1)
    reply = http.post("/v2/models/tensorrt_llm/infer", content=body.encode())
    assert reply.status_code == 400, reply.text
    generate = '{"text_input": ' + data.replace("1", '"hi"') + ', "max_tokens": 2}'
    reply = http.post("/v2/models/ensemble/generate", content=generate.encode())
    assert reply.status_code == 400, reply.text


def test_a_streamed_grpc_batch_of_two_is_an_error(tc_grpc, ref):
    ids = ref["prompt_ids"]
    arrays = {
        "input_ids": np.array([ids, ids], dtype=np.int32),
        "input_lengths": np.array([[len(ids)]] * 2, dtype=np.int32),
        "request_output_len": np.array([[2]] * 2, dtype=np.int32),
        "streaming": np.array([[True]] * 2, dtype=bool),
    }
    with pytest.raises(InferenceServerException, match="batch size 1"):
        _stream(tc_grpc, "tensorrt_llm", _inputs(grpcclient, arrays))


def test_bad_requests_over_http_and_grpc(http, tc_http, tc_grpc, ref):
    assert http.post("/v2/models/tensorrt_llm/infer", content=b"{not json").status_code == 400
    assert http.post("/v2/models/nope/infer", json=_infer_body()).status_code == 404
    short = http.post(
        "/v2/models/tensorrt_llm/infer",
        content=json.dumps(_infer_body()).encode() + b"\x00\x01",
        headers={"Inference-Header-Content-Length": "9999"},
    )
    assert short.status_code == 400
    # Binary data whose size does not fit the shape.
    header = json.dumps(
        _infer_body(
            input_ids={"datatype": "INT32", "shape": [1, 3], "parameters": {"binary_data_size": 8}}
        )
    ).encode()
    reply = http.post(
        "/v2/models/tensorrt_llm/infer",
        content=header + b"\x00" * 8,
        headers={"Inference-Header-Content-Length": str(len(header))},
    )
    assert reply.status_code == 400 and "bytes" in reply.json()["error"]
    assert http.post("/v2/models/ensemble/generate", json={"max_tokens": 2}).status_code == 400
    reply = http.post(
        "/v2/models/ensemble/generate",
        json={"text_input": "hi", "max_tokens": 2, "max_token": 5},
    )
    assert reply.status_code == 400 and "max_token" in reply.json()["error"]
    with pytest.raises(InferenceServerException, match="data-type") as err:
        tc_http.infer(
            "tensorrt_llm",
            _inputs(
                httpclient,
                {
                    "input_ids": np.array([[1, 2]], dtype=np.int64),
                    "input_lengths": np.array([[2]], dtype=np.int32),
                    "request_output_len": np.array([[2]], dtype=np.int32),
                },
            ),
        )
    assert err.value.status() == "400"
    grpc_cases = {
        "wrong dtype": {"input_ids": np.array([[1, 2]], dtype=np.int64)},
        "wrong shape": {"input_ids": np.array([1, 2], dtype=np.int32)},
        "missing input": {"request_output_len": None},
        "bad words": {"bad_words_list": np.array([[[5], [1]]], dtype=np.int32)},
    }
    for case, change in grpc_cases.items():
        arrays = {
            "input_ids": np.array([[1, 2]], dtype=np.int32),
            "input_lengths": np.array([[2]], dtype=np.int32),
            "request_output_len": np.array([[2]], dtype=np.int32),
        }
        arrays.update(change)
        arrays = {k: v for k, v in arrays.items() if v is not None}
        with pytest.raises(InferenceServerException) as err:
            tc_grpc.infer("tensorrt_llm", _inputs(grpcclient, arrays))
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT", case
    with pytest.raises(InferenceServerException) as err:
        tc_grpc.infer("nope", _token_inputs(grpcclient, [1, 2]))
    assert err.value.status() == "StatusCode.NOT_FOUND"
    # An error on the stream is a response with error_message; the stream itself goes on.
    with pytest.raises(InferenceServerException, match="bad_words"):
        _stream(
            tc_grpc,
            "tensorrt_llm",
            _token_inputs(
                grpcclient, [1, 2], bad_words_list=np.array([[[5], [1]]], dtype=np.int32)
            ),
        )
    # ...and the server still serves.
    result = tc_grpc.infer(
        "tensorrt_llm",
        _token_inputs(grpcclient, ref["prompt_ids"], exclude_input_in_output=np.array([[True]])),
    )
    assert result.as_numpy("output_ids")[0, 0].tolist() == ref["ids"]


def test_api_key_guards_grpc_and_v2_routes(engine):
    with _serve(engine, api_key="sekret") as srv:
        url = f"127.0.0.1:{srv.app.state.grpc_port}"
        client = grpcclient.InferenceServerClient(url)
        try:
            with pytest.raises(InferenceServerException) as err:
                client.get_model_metadata("ensemble")
            assert err.value.status() == "StatusCode.UNAUTHENTICATED"
            meta = client.get_model_metadata("ensemble", headers={"authorization": "Bearer sekret"})
            assert meta.name == "ensemble"
        finally:
            client.close()
        assert httpx.get(srv.base_url + "/v2/models/ensemble").status_code == 401


def _wait_idle(server, engine, timeout: float = 20.0) -> bool:
    """The server's books empty and the engine holding no request (its KV blocks freed). Also
    keeps the process from exiting while the engine thread is mid-step: a daemon thread inside
    torch at interpreter exit aborts Python 3.11."""
    lifecycle = server.app.state.kiln.lifecycle
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        books_empty = not lifecycle.in_flight and lifecycle.num_waiting == 0
        if books_empty and not offline(engine, lambda llm: llm.engine.has_unfinished_requests()):
            return True
        time.sleep(0.05)
    return False


def _aborted(http) -> float:
    """Completions counted as aborted (finished_reason="abort": the client left)."""
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("kiln:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_clients_that_leave_mid_stream_free_their_requests(server, engine, http, ref):
    """A gRPC stream cancelled and an SSE stream closed after their first token: both requests
    are aborted (counted so, not finished) and leave the engine (a 400-token generation would
    hold it for a minute here)."""
    aborted = _aborted(http)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    # end_id -1: no EOS ends it early, only the abort can.
    long = {
        "request_output_len": np.array([[400]], dtype=np.int32),
        "end_id": np.array([[-1]], dtype=np.int32),
    }
    inputs = _token_inputs(grpcclient, ref["prompt_ids"], streaming=np.array([[True]]), **long)
    client.async_stream_infer("tensorrt_llm", inputs)
    result, error = results.get(timeout=60)
    assert error is None and result.as_numpy("output_ids").size >= 1
    client.stop_stream(cancel_requests=True)
    client.close()
    assert _wait_idle(server, engine), "the cancelled gRPC stream's request is still in flight"
    assert _aborted(http) == aborted + 1
    body = {"text_input": PROMPT, "max_tokens": 400, "stream": True, "end_id": -1}
    with http.stream("POST", "/v2/models/ensemble/generate_stream", json=body) as s:
        first = next(line for line in s.iter_lines() if line.startswith("data: "))
        assert "text_output" in first, first
    assert _wait_idle(server, engine), "the closed SSE stream's request is still in flight"
    assert _aborted(http) == aborted + 2


def test_draining_server_answers_unavailable(server, http, tc_http, tc_grpc):
    lifecycle = server.app.state.kiln.lifecycle
    lifecycle.draining = True
    try:
        assert not tc_http.is_server_ready() and not tc_grpc.is_server_ready()
        assert not tc_grpc.is_model_ready("ensemble")
        assert tc_grpc.is_server_live()
        reply = http.post("/v2/models/tensorrt_llm/infer", json=_infer_body())
        assert reply.status_code == 503 and "shutting down" in reply.json()["error"]
        with pytest.raises(InferenceServerException) as err:
            tc_grpc.infer("tensorrt_llm", _token_inputs(grpcclient, [1, 2]))
        assert err.value.status() == "StatusCode.UNAVAILABLE"
    finally:
        lifecycle.draining = False
    assert tc_grpc.is_server_ready()
