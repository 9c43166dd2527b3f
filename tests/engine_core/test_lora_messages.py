"""A request's LoRARequest crosses to the engine process field by field, checked as it lands."""

from __future__ import annotations

import msgspec
import pytest

from kiln.engine_core import messages
from kiln.lora.request import LoRARequest
from kiln.sampling_params import SamplingParams


def test_add_request_carries_its_adapter():
    lora = LoRARequest("sql", 3, "/adapters/sql")
    for sent in (
        messages.AddRequest("r1", [1, 2], SamplingParams(max_tokens=3), 0, lora),
        messages.AddRequest("r2", [1], SamplingParams(), 1),
    ):
        got = messages.decode_input(messages.encoder.encode(sent))
        assert got == sent


def test_a_bad_adapter_id_does_not_decode():
    bad = {"lora_name": "x", "lora_int_id": 0, "lora_path": "/p"}
    params = msgspec.to_builtins(SamplingParams())
    frame = messages.encoder.encode(["add", "r1", [1], params, 0, bad])
    with pytest.raises(msgspec.ValidationError, match="lora_int_id"):
        messages.input_decoder.decode(frame)
