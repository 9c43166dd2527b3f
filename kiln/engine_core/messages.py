"""What crosses the API <-> engine process boundary: msgspec structs (msgpack on the wire), a
tagged union each way. Nothing is ever unpickled from a socket: a decode either yields one of
these types, validated field by field, or the frame is dropped and logged (never fatal: the
sockets take only each other's process, so a bad frame is a bug to report, not a reason to die).

One `Outputs` message per engine step carries every request's delta of that step (token ids and
text), the acceptances of the adds it took in, and the engine's snapshot when it changed.
"""

from __future__ import annotations

import logging

import msgspec

from kiln.engine.step_loop import EngineSnapshot
from kiln.lora.request import LoRARequest
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams


# ---- API process -> engine process ---------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    lora: LoRARequest | None = None  # its LoRA adapter (a dataclass: msgspec checks each field)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    req_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class LoRACall(msgspec.Struct, tag="lora", array_like=True):
    """add_lora (`lora` given), remove_lora (`remove_id` given) or list_loras (neither),
    answered by a LoRAReply with the same `call_id` to the API process that asked."""

    call_id: int
    lora: LoRARequest | None = None
    remove_id: int | None = None


EngineInput = AddRequest | Abort | Shutdown | LoRACall


# ---- engine process -> API process ---------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    max_model_len: int
    vocab_size: int
    default_params: SamplingParams
    cache_config: dict[str, str]


class StartupFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str  # what the user must read: the engine's own error, as `kiln serve` prints it


class Rejected(msgspec.Struct, array_like=True):
    req_id: str
    message: str
    param: str | None = None
    code: str | None = None


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    accepted: list[str]
    rejected: list[Rejected]
    deltas: list[RequestOutput]  # prompt_token_ids emptied: the client knows each prompt
    snapshot: EngineSnapshot | None = None


class EngineDied(msgspec.Struct, tag="died", array_like=True):
    message: str


class LoRAReply(msgspec.Struct, tag="lora_reply", array_like=True):
    call_id: int
    error: str | None = None  # the engine's one-line LoRAError; None: done
    result: bool = True  # add_lora / remove_lora's
    lora_ids: list[int] = []  # list_loras'


EngineOutput = Ready | StartupFailed | Outputs | EngineDied | LoRAReply

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineInput)
output_decoder = msgspec.msgpack.Decoder(EngineOutput)


logger = logging.getLogger("kiln.engine_core")


def decode_input(frame: bytes | memoryview) -> EngineInput | None:
    """An API process's message, or None (logged) if the frame is not one."""
    return _decode(input_decoder, frame, "API -> engine")


def decode_output(frame: bytes | memoryview) -> EngineOutput | None:
    """The engine's message, or None (logged) if the frame is not one."""
    return _decode(output_decoder, frame, "engine -> API")


def _decode(decoder: msgspec.msgpack.Decoder, frame: bytes | memoryview, where: str):
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as exc:
        logger.warning("dropped an undecodable %s frame of %d bytes: %s", where, len(frame), exc)
        return None
