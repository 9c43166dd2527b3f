"""A LoRA-wrapped projection adds each token's adapter to the base method's output, a fused qkv
projection's slices each in its own columns; over a float8 (FP8 W8A8) base it keeps the base's
float8 input and reads that input (with its scale) itself; the wrapper offers the fused norm
kernels nothing, and a step without adapters runs no LoRA kernel."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import reference
from kiln.layers.linear import Linear, UnquantizedLinearMethod
from kiln.layers.quantization import linear_method_factory
from kiln.lora.layers import LoRAInputs, LoRALinearMethod

SIZES = [16, 8, 8]  # q, k, v rows of a fused projection
IN, RANK, MAX_RANK, SLOTS = 32, 2, 4, 3


@pytest.mark.parametrize("scheme", ["none", "fp8-dynamic"])
def test_lora_adds_each_tokens_adapter(scheme: str) -> None:
    torch.manual_seed(0)
    base = UnquantizedLinearMethod() if scheme == "none" else linear_method_factory(scheme)("qkv")
    layer = Linear(IN, sum(SIZES), output_sizes=SIZES, method=base, dtype=torch.float32)
    layer.weight_loader(layer.weight, None, torch.randn(sum(SIZES), IN) * 0.1)
    layer.method.process_weights_after_loading(layer)
    inputs = LoRAInputs(8, torch.device("cpu"))
    lora = LoRALinearMethod(layer.method, inputs, layer, SLOTS, MAX_RANK, torch.float32)
    assert lora.fused_operands(layer) is None
    assert (lora.fp8_input(layer) is None) == (scheme == "none")
    layer.method = lora
    # Slot 1: an adapter on q and v only (k's slice zero), rank 2 of the slots' 4.
    a = {0: torch.randn(RANK, IN), 2: torch.randn(RANK, IN)}
    b = {0: torch.randn(SIZES[0], RANK), 2: torch.randn(SIZES[2], RANK)}
    starts = [0, SIZES[0], SIZES[0] + SIZES[1]]
    for piece in a:
        lora.lora_a[1, piece * MAX_RANK : piece * MAX_RANK + RANK] = a[piece]
        lora.lora_b[1, starts[piece] : starts[piece] + SIZES[piece], :RANK] = b[piece]
    x = torch.randn(5, IN)
    inputs.fill([1, -1, 1], [2, 2, 1], 5)  # tokens 0-1 and 4: slot 1; 2-3: the base
    got = layer(reference, x)
    base_out = base.apply(layer, reference, x)
    expected = base_out.clone()
    for piece in a:
        delta = x @ a[piece].T @ b[piece].T  # the unquantized input's product
        cols = slice(starts[piece], starts[piece] + SIZES[piece])
        expected[[0, 1, 4], cols] += delta[[0, 1, 4]]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2:4], base_out[2:4])
    into = lora.fp8_input(layer)
    if into is not None:  # the float8 input the norm before it made: LoRA reads x_q * scale
        x_fp8, scale = reference.quantize_fp8(x, into.static_scale)
        got = layer.apply_fp8(reference, x_fp8, scale, torch.float32)
        expected = base.apply_fp8(layer, reference, x_fp8, scale, torch.float32)
        x_seen = x_fp8.float() * scale
        for piece in a:
            delta = x_seen @ a[piece].T @ b[piece].T
            cols = slice(starts[piece], starts[piece] + SIZES[piece])
            expected[[0, 1, 4], cols] += delta[[0, 1, 4]]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    inputs.fill([-1, -1], [2, 3], 5)  # no adapter in the step: the base's output alone
    calls = []
    ops = _Counting(reference, calls)
    assert torch.equal(layer(ops, x), base.apply(layer, reference, x)) and not calls


class _Counting:
    """An ops module that records the LoRA kernels called."""

    def __init__(self, ops, calls: list) -> None:
        self._ops, self._calls = ops, calls

    def __getattr__(self, name: str):
        if name.startswith("lora_"):
            self._calls.append(name)
        return getattr(self._ops, name)


def test_token_slots_pad_with_no_adapter() -> None:
    inputs = LoRAInputs(8, torch.device("cpu"))
    inputs.fill([2, 0], [1, 3], 6)
    assert inputs.token_slots[:6].tolist() == [2, 0, 0, 0, -1, -1] and inputs.active
    # The rows grouped by slot (in step order within a slot), those without an adapter last.
    assert inputs.order_for(6).tolist() == [1, 2, 3, 0, 4, 5]
    assert inputs.slots_for(6).data_ptr() == inputs.token_slots.data_ptr()
    before = inputs.token_slots.clone()
    inputs.fill([-1, -1, -1], [1, 1, 1], 4)  # a step without adapters: no kernel reads them
    assert not inputs.active and torch.equal(inputs.token_slots, before)
    inputs.fill([-1, 1], [1, 1], 4)
    assert inputs.token_slots[:4].tolist() == [-1, 1, -1, -1] and inputs.active
    assert inputs.order_for(4).tolist() == [1, 0, 2, 3]
