"""KServe v2 over HTTP/REST, with Triton's binary tensor data and generate extensions:

  GET  /v2                                   server metadata
  GET  /v2/health/live | /v2/health/ready
  GET  /v2/models/{name}[/versions/{v}]      model metadata (also /ready, /config)
  POST /v2/models/{name}[/versions/{v}]/infer
  POST /v2/models/{name}[/versions/{v}]/generate | generate_stream (SSE)
  POST /v2/repository/index

Errors are KServe's `{"error": message}` with the protocol's status (400 for a bad tensor), never
the OpenAI error object the /v1 routes answer with.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import kiln
from kiln.server.generation import ClientDisconnected, unless_disconnected
from kiln.server.kserve import models, tensors
from kiln.server.kserve.core import (
    Inference,
    InferRequest,
    InferResponse,
    InputTensor,
    RequestedOutput,
    find_model,
    max_batch_size,
)
from kiln.server.kserve.errors import KServeError, as_kserve_error, invalid
from kiln.server.state import ServerState, get_state
from kiln.server.text_check import check_strings, may_hold_surrogates

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "generate", "parameters"]
_MAX_INFLATED_BYTES = 64 << 20  # a compressed body may not expand past this


def error_response(exc: BaseException) -> JSONResponse:
    err = as_kserve_error(exc)
    return JSONResponse({"error": err.message}, status_code=err.status.http)


class KServeRoute(APIRoute):
    """Every failure in these routes, FastAPI's own included, leaves as KServe's error."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                return error_response(exc)

        return guarded


router = APIRouter(route_class=KServeRoute)


def _model_paths(suffix: str = "") -> list[str]:
    return [f"/v2/models/{{model}}{suffix}", f"/v2/models/{{model}}/versions/{{version}}{suffix}"]


def _get(paths: list[str]):
    def register(fn):
        for path in paths:
            router.add_api_route(path, fn, methods=["GET"], include_in_schema=False)
        return fn

    return register


def _post(paths: list[str]):
    def register(fn):
        for path in paths:
            router.add_api_route(path, fn, methods=["POST"], include_in_schema=False)
        return fn

    return register


def _ready(state: ServerState) -> bool:
    stalled = state.stall is not None and state.stall.reason() is not None
    return state.engine.healthy and not state.lifecycle.draining and not stalled


# ---- health and metadata -------------------------------------------------------------------


@_get(["/v2"])
async def server_metadata() -> JSONResponse:
    return JSONResponse({"name": "kiln", "version": kiln.__version__, "extensions": EXTENSIONS})


@_get(["/v2/health/live"])
async def live(request: Request) -> Response:
    # Live while the engine loop runs: a dead engine needs a restart, not more traffic.
    return Response(status_code=200 if get_state(request).engine.healthy else 503)


@_get(["/v2/health/ready"])
async def ready(request: Request) -> Response:
    return Response(status_code=200 if _ready(get_state(request)) else 503)


@_get(_model_paths("/ready"))
async def model_ready(request: Request, model: str, version: str = "") -> Response:
    try:
        find_model(model, version)
    except KServeError as exc:  # Triton answers 400 here (404 for the metadata)
        return JSONResponse({"error": exc.message}, status_code=400)
    return Response(status_code=200 if _ready(get_state(request)) else 503)


@_get(_model_paths())
async def model_metadata(model: str, version: str = "") -> JSONResponse:
    return JSONResponse(models.metadata(find_model(model, version)))


@_get(_model_paths("/config"))
async def model_config(request: Request, model: str, version: str = "") -> JSONResponse:
    spec = find_model(model, version)
    return JSONResponse(models.config(spec, max_batch_size(get_state(request))))


@_post(["/v2/repository/index"])
async def repository_index(request: Request) -> JSONResponse:
    state = "READY" if _ready(get_state(request)) else "UNAVAILABLE"
    return JSONResponse(
        [{"name": name, "version": models.VERSION, "state": state} for name in models.MODELS]
    )


# ---- infer ---------------------------------------------------------------------------------


async def _body(request: Request) -> bytes:
    body = await request.body()
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding in ("", "identity"):
        return body
    wbits = {"gzip": 31, "deflate": 15}.get(encoding)
    if wbits is None:
        raise invalid(f"unsupported Content-Encoding '{encoding}' (gzip, deflate)")
    inflater = zlib.decompressobj(wbits)
    try:
        data = inflater.decompress(body, _MAX_INFLATED_BYTES)
    except zlib.error as exc:
        raise invalid(f"the {encoding} body does not decompress: {exc}") from None
    if inflater.unconsumed_tail:
        raise invalid(f"the decompressed body is larger than {_MAX_INFLATED_BYTES} bytes")
    return data


def _json_object(data: bytes, what: str) -> dict:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid(f"{what} is nested too deeply") from None
    if not isinstance(obj, dict):
        raise invalid(f"{what} must be a JSON object")
    if may_hold_surrogates(data):
        check_strings(obj)  # text_input, stop words, parameters: every string, once
    return obj


def _parameters(obj: dict, where: str) -> dict:
    params = obj.get("parameters", {})
    if not isinstance(params, dict):
        raise invalid(f"'parameters' of {where} must be an object")
    return params


def parse_infer(body: bytes, header_length: str | None, model: str, version: str) -> InferRequest:
    """KServe v2's JSON request, with the binary tensor data extension: a JSON header of
    `header_length` bytes, then each binary input's bytes in input order."""
    if header_length is None:
        header, blobs = body, b""
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise invalid(f"{HEADER_LENGTH} {header_length!r} does not fit a {len(body)}-byte body")
        header, blobs = body[: int(header_length)], body[int(header_length) :]
    obj = _json_object(header, "the inference request")
    raw_inputs = obj.get("inputs")
    if not isinstance(raw_inputs, list):
        raise invalid("the inference request needs an 'inputs' list")
    inputs, offset = [], 0
    for i, t in enumerate(raw_inputs):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise invalid(f"inputs[{i}] must be an object with a 'name'")
        name, datatype, shape = t["name"], t.get("datatype"), t.get("shape")
        if not isinstance(datatype, str) or not isinstance(shape, list):
            raise invalid(f"input '{name}' needs a 'datatype' string and a 'shape' list")
        tensors.num_elements(name, shape)
        size = _parameters(t, f"input '{name}'").get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(blobs):
                raise invalid(f"input '{name}': binary_data_size {size!r} runs past the body")
            array = tensors.from_raw(name, datatype, shape, blobs[offset : offset + size])
            offset += size
        elif "data" in t:
            array = tensors.from_values(name, datatype, shape, t["data"])
        else:
            raise invalid(f"input '{name}' has neither 'data' nor binary_data_size")
        inputs.append(InputTensor(name, datatype, array))
    if offset != len(blobs):
        raise invalid(f"{len(blobs) - offset} bytes of binary data belong to no input")
    outputs = []
    for i, o in enumerate(obj.get("outputs") or []):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise invalid(f"outputs[{i}] must be an object with a 'name'")
        params = _parameters(o, f"output '{o['name']}'")
        unknown = sorted(set(params) - {"binary_data"})
        if unknown:
            raise invalid(f"output '{o['name']}': parameters {unknown} are not supported")
        binary = params.get("binary_data")
        outputs.append(RequestedOutput(o["name"], None if binary is None else bool(binary)))
    request_id = obj.get("id", "")
    return InferRequest(
        model,
        version,
        inputs,
        outputs,
        _parameters(obj, "the inference request"),
        request_id if isinstance(request_id, str) else str(request_id),
    )


def infer_response(request: InferRequest, response: InferResponse) -> Response:
    """JSON, or JSON header + binary outputs where the request asked for binary data."""
    binary_default = bool(request.parameters.get("binary_data_output", False))
    per_output = {o.name: o.binary for o in request.outputs}
    outputs, blobs = [], []
    for t in response.outputs:
        binary = per_output.get(t.name)
        entry: dict[str, object] = {
            "name": t.name,
            "datatype": t.datatype,
            "shape": list(t.array.shape),
        }
        if binary_default if binary is None else binary:
            blob = tensors.to_raw(t.datatype, t.array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = tensors.to_json_values(t.datatype, t.array)
        outputs.append(entry)
    head = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id:
        head["id"] = response.id
    header = json.dumps({**head, "outputs": outputs}, separators=(",", ":")).encode()
    if not blobs:
        return Response(header, media_type="application/json")
    return Response(
        b"".join([header, *blobs]),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(header))},
    )


async def _run_to_end(raw: Request, inference: Inference) -> InferResponse | None:
    """The single response of a non-streaming inference; None if the client left (its rows are
    aborted)."""

    async def last() -> InferResponse:
        result = None
        async for response in inference.responses():
            result = response
        assert result is not None  # a non-streaming inference ends with its one response
        return result

    try:
        return await unless_disconnected(raw, last())
    except ClientDisconnected:
        return None
    finally:
        inference.close()


@_post(_model_paths("/infer"))
async def infer(raw: Request, model: str, version: str = "") -> Response:
    request = parse_infer(await _body(raw), raw.headers.get(HEADER_LENGTH), model, version)
    inference = await Inference.start(get_state(raw), request, allow_streaming=False)
    response = await _run_to_end(raw, inference)
    return Response(status_code=499) if response is None else infer_response(request, response)


# ---- generate extension --------------------------------------------------------------------


def _shape_of(name: str, value: object) -> list[int]:
    """The shape of a JSON value: [] for a scalar, nested lists must be rectangular."""
    shape: list[int] = []
    level: list[Any] = [value]  # JSON values
    while all(isinstance(v, list) for v in level):
        sizes = {len(v) for v in level}
        if len(sizes) != 1:
            raise invalid(f"'{name}' is a ragged list")
        size = sizes.pop()
        shape.append(size)
        if size == 0:
            return shape
        level = [x for v in level for x in v]
    if any(isinstance(v, list) for v in level):
        raise invalid(f"'{name}' mixes lists and values at one depth")
    return shape


def parse_generate(body: bytes, model: str, version: str) -> InferRequest:
    """Triton's generate request: each field that names a model input (top level or in
    `parameters`) is that input, with a batch of one; the rest are request parameters."""
    spec = find_model(model, version)
    obj = _json_object(body, "the generate request")
    fields = {k: v for k, v in obj.items() if k != "parameters"}
    for key, value in _parameters(obj, "the generate request").items():
        if key in fields:
            raise invalid(f"'{key}' is given both as a field and as a parameter")
        fields[key] = value
    inputs, parameters = [], {}
    for key, value in fields.items():
        declared = spec.input(key)
        if declared is None:
            parameters[key] = value  # refused by name in Inference.start unless known
            continue
        shape = _shape_of(key, value) or [1]
        array = tensors.from_values(key, declared.datatype, [1, *shape], value)
        inputs.append(InputTensor(key, declared.datatype, array))
    return InferRequest(model, version, inputs, [], parameters)


def generate_body(response: InferResponse) -> dict:
    out: dict = {"model_name": response.model_name, "model_version": response.model_version}
    for t in response.outputs:
        values = tensors.to_json_values(t.datatype, t.array)
        out[t.name] = values[0] if len(values) == 1 else values
    return out


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@_post(_model_paths("/generate"))
async def generate(raw: Request, model: str, version: str = "") -> Response:
    request = parse_generate(await _body(raw), model, version)
    inference = await Inference.start(get_state(raw), request, allow_streaming=False)
    response = await _run_to_end(raw, inference)
    if response is None:
        return Response(status_code=499)
    return Response(_dumps(generate_body(response)), media_type="application/json")


@_post(_model_paths("/generate_stream"))
async def generate_stream(raw: Request, model: str, version: str = "") -> Response:
    request = parse_generate(await _body(raw), model, version)
    inference = await Inference.start(get_state(raw), request, allow_streaming=True)
    return StreamingResponse(_sse(inference), media_type="text/event-stream; charset=utf-8")


async def _sse(inference: Inference) -> AsyncIterator[bytes]:
    """One `data:` event per response; an error after the 200 is an event with `error` (the
    generate extension's rule), then the stream ends."""
    try:
        async for response in inference.responses():
            yield b"data: " + _dumps(generate_body(response)) + b"\n\n"
    except Exception as exc:
        err = as_kserve_error(exc)
        yield b"data: " + _dumps({"error": err.message}) + b"\n\n"
    finally:
        inference.close()
