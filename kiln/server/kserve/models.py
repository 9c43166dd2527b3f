"""The two models kiln serves over KServe v2, declared as the TensorRT-LLM backend's
config.pbtxt files declare them (triton-inference-server/tensorrtllm_backend,
all_models/inflight_batcher_llm/{tensorrt_llm,ensemble}/config.pbtxt), so Triton clients written
for those models work unchanged:

- `tensorrt_llm`: token ids in, token ids out (the backend model itself).
- `ensemble`: text in, text out (preprocessing -> tensorrt_llm -> postprocessing in Triton; here
  the engine's own tokenizer and incremental detokenizer do both ends).

Only the inputs kiln honours are declared (plus `bad_words_list`/`bad_words`, declared so a client
that sends them is told they are not supported rather than that they are unknown). Both models
have a batch dimension (max_batch_size > 0): shapes on the wire carry it first, as with Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

VERSION = "1"  # Triton reports version "1" for a model directory with one version


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe datatype: INT32, FP32, BOOL, BYTES ...
    dims: tuple[int, ...]  # without the batch dimension; -1 is any size
    optional: bool = False


@dataclass(frozen=True)
class ModelSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    default_outputs: tuple[str, ...]  # returned when the request names none
    exclude_input_in_output: bool = False  # the backend's parameter of that name; a request may
    # override it with the input of that name

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)


def _opt(name: str, datatype: str, dims: tuple[int, ...] = (1,)) -> TensorSpec:
    return TensorSpec(name, datatype, dims, optional=True)


TENSORRT_LLM = ModelSpec(
    name="tensorrt_llm",
    inputs=(
        TensorSpec("input_ids", "INT32", (-1,)),
        TensorSpec("input_lengths", "INT32", (1,)),
        TensorSpec("request_output_len", "INT32", (1,)),
        _opt("end_id", "INT32"),
        _opt("pad_id", "INT32"),
        _opt("stop_words_list", "INT32", (2, -1)),
        _opt("bad_words_list", "INT32", (2, -1)),
        _opt("beam_width", "INT32"),
        _opt("temperature", "FP32"),
        _opt("runtime_top_k", "INT32"),
        _opt("runtime_top_p", "FP32"),
        _opt("repetition_penalty", "FP32"),
        _opt("presence_penalty", "FP32"),
        _opt("frequency_penalty", "FP32"),
        _opt("min_tokens", "INT32"),
        _opt("min_length", "INT32"),  # the older configs' name of min_tokens
        _opt("seed", "UINT64"),
        _opt("random_seed", "UINT64"),  # the older configs' name of seed
        _opt("return_log_probs", "BOOL"),
        _opt("exclude_input_in_output", "BOOL"),
        _opt("streaming", "BOOL"),
    ),
    outputs=(
        TensorSpec("output_ids", "INT32", (-1, -1)),  # [beam, tokens]
        TensorSpec("sequence_length", "INT32", (-1,)),  # [beam]
        TensorSpec("cum_log_probs", "FP32", (-1,)),
        TensorSpec("output_log_probs", "FP32", (-1, -1)),
    ),
    default_outputs=("output_ids", "sequence_length"),
)

ENSEMBLE = ModelSpec(
    name="ensemble",
    inputs=(
        TensorSpec("text_input", "BYTES", (1,)),
        TensorSpec("max_tokens", "INT32", (1,)),
        _opt("bad_words", "BYTES", (-1,)),
        _opt("stop_words", "BYTES", (-1,)),
        _opt("exclude_input_in_output", "BOOL"),
        _opt("end_id", "INT32"),
        _opt("pad_id", "INT32"),
        _opt("top_k", "INT32"),
        _opt("top_p", "FP32"),
        _opt("temperature", "FP32"),
        _opt("repetition_penalty", "FP32"),
        _opt("min_tokens", "INT32"),
        _opt("presence_penalty", "FP32"),
        _opt("frequency_penalty", "FP32"),
        _opt("seed", "UINT64"),
        _opt("random_seed", "UINT64"),
        _opt("return_log_probs", "BOOL"),
        _opt("beam_width", "INT32"),
        _opt("stream", "BOOL"),
    ),
    outputs=(
        TensorSpec("text_output", "BYTES", (-1,)),
        TensorSpec("cum_log_probs", "FP32", (-1,)),
        TensorSpec("output_log_probs", "FP32", (-1, -1)),
    ),
    default_outputs=("text_output",),
)

MODELS: dict[str, ModelSpec] = {m.name: m for m in (TENSORRT_LLM, ENSEMBLE)}


def metadata(spec: ModelSpec) -> dict:
    """KServe v2 model metadata; shapes include the batch dimension (-1)."""

    def tensor(t: TensorSpec) -> dict:
        return {"name": t.name, "datatype": t.datatype, "shape": [-1, *t.dims]}

    return {
        "name": spec.name,
        "versions": [VERSION],
        "platform": "kiln",
        "inputs": [tensor(t) for t in spec.inputs],
        "outputs": [tensor(t) for t in spec.outputs],
    }


def config(spec: ModelSpec, max_batch_size: int) -> dict:
    """The model's configuration in Triton's form (model_config.proto as JSON): what
    `get_model_config` returns, and parsed into the ModelConfig message for gRPC."""

    def tensor(t: TensorSpec, is_input: bool) -> dict:
        out: dict[str, object] = {
            "name": t.name,
            "data_type": f"TYPE_{_type_name(t.datatype)}",
            "dims": list(t.dims),
        }
        if is_input:
            out["optional"] = t.optional
        return out

    return {
        "name": spec.name,
        "backend": "kiln",
        "max_batch_size": max_batch_size,
        "input": [tensor(t, True) for t in spec.inputs],
        "output": [tensor(t, False) for t in spec.outputs],
        "model_transaction_policy": {"decoupled": True},  # streams several responses
        "parameters": {
            "exclude_input_in_output": {"string_value": str(spec.exclude_input_in_output).lower()}
        },
    }


def _type_name(datatype: str) -> str:
    return "STRING" if datatype == "BYTES" else datatype  # model_config.proto's spelling
