"""One inference request of the protocol, whatever carried it (HTTP JSON, HTTP binary, gRPC):
check it against the model's declaration, submit its rows through the server's shared
Generation (admission, in-flight books for the drain, metrics, aborts), and turn the engine's
deltas into responses. Streaming (decoupled) requests get a response per new token and a last
one marked final; others get one response when every row has finished."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from kiln.server.generation import Generation
from kiln.server.kserve import translate
from kiln.server.kserve.errors import KServeError, Status, invalid
from kiln.server.kserve.models import MODELS, VERSION, ModelSpec
from kiln.server.state import ServerState

# Request parameters kiln acts on; any other is refused rather than ignored.
KNOWN_PARAMETERS = frozenset({"binary_data_output", "triton_enable_empty_final_response"})


@dataclass
class InputTensor:
    name: str
    datatype: str
    array: np.ndarray  # shaped as sent, batch dimension first


@dataclass
class RequestedOutput:
    name: str
    binary: bool | None = None  # HTTP's per-output binary_data parameter


@dataclass
class InferRequest:
    model_name: str
    model_version: str
    inputs: list[InputTensor]
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: dict[str, object] = field(default_factory=dict)
    id: str = ""


@dataclass
class OutputTensor:
    name: str
    datatype: str
    array: np.ndarray


@dataclass
class InferResponse:
    model_name: str
    id: str
    outputs: list[OutputTensor]
    final: bool
    model_version: str = VERSION


def find_model(name: str, version: str = "") -> ModelSpec:
    spec = MODELS.get(name)
    if spec is None:
        raise KServeError(
            f"Request for unknown model: '{name}' is not found (this server serves "
            f"{sorted(MODELS)})",
            Status.NOT_FOUND,
        )
    if version not in ("", VERSION):
        raise KServeError(
            f"Request for unknown model: '{name}' version {version} is not found (only "
            f"version {VERSION})",
            Status.NOT_FOUND,
        )
    return spec


def max_batch_size(state: ServerState) -> int:
    # One request's rows queue together: as many as the waiting queue holds.
    return state.lifecycle.max_waiting


def check_inputs(spec: ModelSpec, inputs: list[InputTensor], max_batch: int) -> dict:
    """name -> array, after Triton's checks: every name declared and given once, required
    ones present, datatypes equal, shapes [batch, *dims] with one batch size."""
    by_name: dict[str, np.ndarray] = {}
    for t in inputs:
        declared = spec.input(t.name)
        if declared is None:
            raise invalid(f"unexpected inference input '{t.name}' for model '{spec.name}'")
        if t.name in by_name:
            raise invalid(f"input '{t.name}' is given twice")
        if t.datatype != declared.datatype:
            raise invalid(
                f"inference input '{t.name}' data-type is '{t.datatype}', but model "
                f"'{spec.name}' expects '{declared.datatype}'"
            )
        shape = list(t.array.shape)
        expected = [-1, *declared.dims]
        fits = len(shape) == len(expected) and all(
            e == -1 or e == s for e, s in zip(expected, shape)
        )
        if not fits:
            raise invalid(
                f"unexpected shape for input '{t.name}' for model '{spec.name}'. Expected "
                f"{expected}, got {shape}"
            )
        if t.array.dtype.kind == "f" and not np.isfinite(t.array).all():
            raise invalid(f"input '{t.name}' holds NaN or infinity")
        by_name[t.name] = t.array
    missing = [t.name for t in spec.inputs if not t.optional and t.name not in by_name]
    if missing:
        raise invalid(
            f"expected {len(missing) + len(by_name)} inputs but got {len(by_name)} inputs for "
            f"model '{spec.name}'; missing required input(s) {missing}"
        )
    batches = {name: arr.shape[0] for name, arr in by_name.items()}
    sizes = set(batches.values())
    if len(sizes) > 1:
        raise invalid(f"inputs of model '{spec.name}' have different batch sizes: {batches}")
    batch = sizes.pop()
    if not 1 <= batch <= max_batch:
        raise invalid(
            f"inference request batch-size must be in [1, {max_batch}] for '{spec.name}', "
            f"got {batch}"
        )
    return by_name


class Inference:
    """`await Inference.start(...)` (raises the protocol's error before anything is sent),
    iterate `responses()`, and always `close()` (aborts what is unfinished)."""

    def __init__(self, spec: ModelSpec, request: InferRequest, plan: translate.Plan) -> None:
        self.spec = spec
        self.request = request
        self.plan = plan
        self.gen: Generation | None = None

    @property
    def streaming(self) -> bool:
        return self.plan.streaming

    @classmethod
    async def start(
        cls, state: ServerState, request: InferRequest, *, allow_streaming: bool
    ) -> Inference:
        spec = find_model(request.model_name, request.model_version)
        unknown = sorted(set(request.parameters) - KNOWN_PARAMETERS)
        if unknown:
            raise invalid(f"request parameter(s) {unknown} are not supported by kiln")
        for out in request.outputs:
            if spec.output(out.name) is None:
                raise invalid(f"unexpected inference output '{out.name}' for model '{spec.name}'")
        inputs = check_inputs(spec, request.inputs, max_batch_size(state))
        names = tuple(o.name for o in request.outputs) or None
        plan = translate.plan(spec, inputs, names, state, state.new_id("kserve"))
        if plan.streaming and not allow_streaming:
            raise invalid(
                "streaming responses need ModelStreamInfer (gRPC) or generate_stream (HTTP)"
            )
        if plan.streaming and len(plan.rows) > 1:
            raise invalid("streaming takes one row per request (batch size 1)")
        self = cls(spec, request, plan)
        self.gen = await Generation.start(
            state.engine, state.lifecycle, state.metrics, plan.requests
        )
        return self

    def _response(self, streamed: bool, final: bool) -> InferResponse:
        tensors = translate.output_tensors(self.spec, self.plan, streamed)
        outputs = [OutputTensor(name, dt, arr) for name, (dt, arr) in tensors.items()]
        return InferResponse(self.spec.name, self.request.id, outputs, final)

    async def responses(self) -> AsyncIterator[InferResponse]:
        assert self.gen is not None
        rows = self.plan.rows
        async for index, delta in self.gen.deltas():
            row = rows[index]
            for out in delta.outputs:
                row.advance(out)
            if row.finish_reason == "abort":
                raise KServeError(
                    "the request was aborted (the server is shutting down)", Status.UNAVAILABLE
                )
            if self.streaming and (row.new_ids or delta.finished):
                yield self._response(streamed=True, final=delta.finished)
                row.take_new()
        if not self.streaming:
            yield self._response(streamed=False, final=True)

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()
