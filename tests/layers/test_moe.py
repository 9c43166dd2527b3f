"""FusedMoE's choice of kernel by the step's size and the experts' weights (kiln.layers.moe):
the decode GEMVs up to MAX_DECODE_TOKENS tokens, then the float8 tensor-core grouped GEMM for
float8 experts and the model-dtype grouped GEMM otherwise; the router through ops.moe_route."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.kernels import reference
from kiln.layers.moe import MAX_DECODE_TOKENS, Fp8MoEMethod, FusedMoE


def _recording_ops(calls: list[str]) -> SimpleNamespace:
    def record(name: str):
        def run(*args, **kwargs):
            calls.append(name)
            return getattr(reference, name)(*args, **kwargs)

        return run

    names = ("moe_route", "fused_moe", "fused_moe_decode", "fused_moe_fp8")
    return SimpleNamespace(**{name: record(name) for name in names})


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, MAX_DECODE_TOKENS, MAX_DECODE_TOKENS + 1, 64])
def test_the_kernel_follows_the_token_count_and_the_weights(num_tokens, fp8) -> None:
    layer = FusedMoE(4, 2, 16, 8, True, torch.float32, Fp8MoEMethod() if fp8 else None)
    with torch.no_grad():
        for p in (layer.w13_weight, layer.w2_weight):
            p.copy_(torch.randn(p.shape).to(p.dtype))
    calls: list[str] = []
    x, logits = torch.randn(num_tokens, 16), torch.randn(num_tokens, 4)
    out = layer(_recording_ops(calls), x, logits)
    assert out.shape == (num_tokens, 16) and torch.isfinite(out).all()
    if num_tokens <= MAX_DECODE_TOKENS:
        want = "fused_moe_decode"
    else:
        want = "fused_moe_fp8" if fp8 else "fused_moe"
    assert calls == ["moe_route", want]
