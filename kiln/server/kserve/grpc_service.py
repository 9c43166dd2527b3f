"""KServe v2's GRPCInferenceService on grpc.aio, in the HTTP server's own event loop (it shares
the engine client, the admission books and the drain with the HTTP routes).

The messages and the service base are the ones `tritonclient[grpc]` generates from Triton's
grpc_service.proto (tritonclient.grpc.service_pb2 / service_pb2_grpc / model_config_pb2), so the
wire format is Triton's by construction. RPCs kiln does not serve (model control, shared memory,
statistics, trace and log settings) answer UNIMPLEMENTED, the generated base's default.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2_grpc
from tritonclient.grpc import service_pb2 as pb

import kiln
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
from kiln.server.kserve.errors import KServeError, Status, as_kserve_error, invalid
from kiln.server.kserve.http import EXTENSIONS
from kiln.server.state import ServerState


def _param_value(p: pb.InferParameter) -> object:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def parse_request(request: pb.ModelInferRequest) -> InferRequest:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise invalid(
            f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs: give raw contents "
            "for every input or for none"
        )
    inputs = []
    for i, t in enumerate(request.inputs):
        shape = list(t.shape)
        if raw:
            array = tensors.from_raw(t.name, t.datatype, shape, raw[i])
        else:
            tensors.check_datatype(t.name, t.datatype)
            field = tensors.GRPC_CONTENTS.get(t.datatype)
            if field is None:
                raise invalid(f"input '{t.name}': {t.datatype} needs raw_input_contents")
            array = tensors.from_values(t.name, t.datatype, shape, list(getattr(t.contents, field)))
        inputs.append(InputTensor(t.name, t.datatype, array))
    outputs = [RequestedOutput(o.name) for o in request.outputs]
    for o in request.outputs:
        if o.parameters:
            raise invalid(
                f"output '{o.name}': output parameters {sorted(o.parameters)} are not supported"
            )
    parameters = {k: _param_value(v) for k, v in request.parameters.items()}
    return InferRequest(
        request.model_name, request.model_version, inputs, outputs, parameters, request.id
    )


def to_proto(response: InferResponse, final_flag: bool | None = None) -> pb.ModelInferResponse:
    msg = pb.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    for t in response.outputs:
        msg.outputs.add(name=t.name, datatype=t.datatype, shape=list(t.array.shape))
        msg.raw_output_contents.append(tensors.to_raw(t.datatype, t.array))
    if final_flag is not None:
        msg.parameters["triton_final_response"].bool_param = final_flag
    return msg


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _ready(self) -> bool:
        stall = self.state.stall
        stalled = stall is not None and stall.reason() is not None
        return self.state.engine.healthy and not self.state.lifecycle.draining and not stalled

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.state.engine.healthy)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, request, context):
        known = request.name in models.MODELS and request.version in ("", models.VERSION)
        return pb.ModelReadyResponse(ready=known and self._ready())

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(
            name="kiln", version=kiln.__version__, extensions=EXTENSIONS
        )

    async def ModelMetadata(self, request, context):
        spec = await _or_abort(context, lambda: find_model(request.name, request.version))
        return json_format.ParseDict(models.metadata(spec), pb.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        spec = await _or_abort(context, lambda: find_model(request.name, request.version))
        config = models.config(spec, max_batch_size(self.state))
        return pb.ModelConfigResponse(
            config=json_format.ParseDict(config, model_config_pb2.ModelConfig())
        )

    async def RepositoryIndex(self, request, context):
        state = "READY" if self._ready() else "UNAVAILABLE"
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(name=n, version=models.VERSION, state=state)
                for n in models.MODELS
            ]
        )

    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        error: KServeError | None = None
        try:
            inference = await Inference.start(
                self.state, parse_request(request), allow_streaming=False
            )
            try:
                last = None
                async for response in inference.responses():
                    last = response
            finally:
                inference.close()  # also when the client cancels: its rows are aborted
            assert last is not None  # a non-streaming inference ends with its one response
            return to_proto(last)
        except Exception as exc:
            error = as_kserve_error(exc)
        await context.abort(error.status.grpc, error.message)

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator:
        """Decoupled: each request on the stream gets its responses (one per new token when it
        streams), interleaved as they come; an error is a response with error_message, and the
        stream stays open for the other requests."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def serve_one(request: pb.ModelInferRequest) -> None:
            empty_final = False
            try:
                parsed = parse_request(request)
                empty_final = bool(parsed.parameters.get("triton_enable_empty_final_response"))
                inference = await Inference.start(self.state, parsed, allow_streaming=True)
            except Exception as exc:
                queue.put_nowait(_stream_error(exc, request.id))
                return
            try:
                async for response in inference.responses():
                    flag = response.final if empty_final else None
                    queue.put_nowait(
                        pb.ModelStreamInferResponse(infer_response=to_proto(response, flag))
                    )
            except Exception as exc:
                queue.put_nowait(_stream_error(exc, request.id))
            finally:
                inference.close()

        async def read_all() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(serve_one(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.wait(set(tasks))
            queue.put_nowait(None)

        reader = asyncio.create_task(read_all())
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                yield item
            await reader  # re-raises a failed read (a broken stream)
        finally:
            pending = [reader, *tasks]
            for task in pending:
                task.cancel()  # the client left: their finally blocks abort the rows
            # Let them end before the RPC does: a read of the request stream still pending when
            # the call is torn down leaves gRPC's core unable to shut down at exit.
            await asyncio.gather(*pending, return_exceptions=True)


def _stream_error(exc: BaseException, request_id: str) -> pb.ModelStreamInferResponse:
    err = as_kserve_error(exc)
    return pb.ModelStreamInferResponse(
        error_message=err.message, infer_response=pb.ModelInferResponse(id=request_id)
    )


async def _or_abort(context, fn: Callable):
    try:
        return fn()
    except Exception as exc:
        err = as_kserve_error(exc)
    await context.abort(err.status.grpc, err.message)


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` metadata, as HTTP's header; compared in constant time."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key.encode()

    async def intercept_service(self, continuation, details):
        metadata = dict(details.invocation_metadata or ())
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key):
            return await continuation(details)

        async def deny(request, context):
            await context.abort(
                Status.UNAUTHENTICATED.grpc,
                "invalid or missing API key (metadata authorization: Bearer <key>)",
            )

        if details.method.endswith("/ModelStreamInfer"):
            return grpc.stream_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def grpc_lifespan(
    host: str, port: int, api_key: str | None, max_message_bytes: int
) -> Callable[[object], AbstractAsyncContextManager[None]]:
    """A FastAPI lifespan that serves gRPC on host:port while the app runs (port 0: any free
    one; the bound port is in app.state.grpc_port)."""

    @contextlib.asynccontextmanager
    async def lifespan(app) -> AsyncIterator[None]:
        server = grpc.aio.server(
            interceptors=[_ApiKeyInterceptor(api_key)] if api_key else None,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", -1),
            ],
        )
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(app.state.kiln), server
        )
        bound = server.add_insecure_port(f"{host}:{port}")
        await server.start()
        app.state.grpc_port = bound
        try:
            yield
        finally:
            await server.stop(grace=2.0)

    return lifespan
