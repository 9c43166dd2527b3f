"""The 8-bit linear methods on the GPU path (TRITON_INTERPRET=1 without a GPU), against the
reference ops that tests/checkpoint/test_eight_bit_checkpoints.py holds to transformers: each
projection of each tiny 8-bit checkpoint (tests/data/eight_bit_checkpoints) on one input, a
whole forward through the Triton kernels and attention backend, and W8A8 INT8's engine with
its activations quantized by the norm and SiLU-mul kernels against the unfused path.

Block FP8's whole forward is left out: the attention's and norms' fp32 sums in another order
move an activation across a float8 rounding boundary now and then, a step of up to 1/16 of it,
which the tiny random model (weights at 0.1) carries to its logits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.attention.backend import get_attention_backend
from kiln.config import EngineConfig
from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.kv_layout import empty_cache
from kiln.models.packed_prefill import packed_prefill_metadata
from kiln.runtime.model_loader import load_model

DATA = Path(__file__).parents[1] / "data" / "eight_bit_checkpoints"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "name", ["ct_fp8_block", "ct_w8a8_int8", "ct_w8a16_int8", "ct_w8a16_fp8", "fp8_block_hf"]
)
def test_each_projection_through_triton_equals_the_reference(name: str) -> None:
    model = load_model(EngineConfig(model=str(DATA / name)), DEVICE, torch.float32).model
    gen = torch.Generator().manual_seed(0)
    for layer in model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj):  # fmt: skip
            x = torch.randn(27, proj.in_features, generator=gen).to(DEVICE)
            got = proj.method.apply(proj, triton_ops, x)
            want = proj.method.apply(proj, reference, x)
            atol = 1e-5
            if DEVICE.type == "cuda" and "fp8_block" in name:
                # Float8 tensor cores accumulate in fewer bits than fp32 (the twin's exact sums).
                atol = 2e-3 * want.abs().max().item()
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("name", ["ct_w8a8_int8", "ct_w8a16_int8"])
def test_triton_forward_equals_the_reference(name: str) -> None:
    model = load_model(EngineConfig(model=str(DATA / name)), DEVICE, torch.float32).model
    cfg = model.config
    lens = [20, 7]
    metadata, blocks = packed_prefill_metadata(lens, 16, DEVICE)
    ids = torch.randint(3, cfg.vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    outs = []
    for ops, backend in ((reference, "torch"), (triton_ops, "triton")):
        shape = (blocks, 16, cfg.num_key_value_heads, cfg.head_dim)
        caches = [
            (empty_cache(*shape, torch.float32, DEVICE), empty_cache(*shape, torch.float32, DEVICE))
            for _ in range(cfg.num_hidden_layers)
        ]
        attention = get_attention_backend(backend, DEVICE)
        with torch.no_grad():
            hidden = model(ops, attention, ids.to(DEVICE), positions, caches, metadata)
            outs.append(model.compute_logits(hidden, ops).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-3)


def test_int8_activations_quantized_by_the_op_before_give_the_unfused_tokens(monkeypatch) -> None:
    """llm-compressor's W8A8 INT8 checkpoint through the engine on the Triton kernels: the norms
    and the SiLU-mul write int8 rows and scales for the int8 GEMM (two norms and one activation
    a layer; only o_proj quantizes in its own kernel), and the greedy tokens equal those of the
    unfused path (the norm, then int8_linear quantizing on its own) and of the reference ops."""
    from kiln import LLM, SamplingParams
    from kiln.kernels.triton import int8_gemm
    from kiln.layers.quantization.int8 import Int8LinearMethod

    calls: dict[str, int] = {}

    def spy(module: object, name: str) -> None:
        real = getattr(module, name)

        def counted(*args: object) -> object:
            calls[name] = calls.get(name, 0) + 1
            return real(*args)

        monkeypatch.setattr(module, name, counted)

    spy(triton_ops, "add_rms_norm_quant_int8")
    spy(triton_ops, "silu_and_mul_quant_int8")
    spy(int8_gemm, "quantize_int8")
    prompts = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    args = dict(dtype="float32", kv_cache_memory_gb=0.02, max_num_seqs=4, enforce_eager=True,
                device=DEVICE.type)  # fmt: skip

    def tokens(backend: str) -> list[list[int]]:
        llm = LLM(str(DATA / "ct_w8a8_int8"), attention_backend=backend, **args)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]

    fused = tokens("triton")
    assert calls["add_rms_norm_quant_int8"] == 2 * calls["silu_and_mul_quant_int8"] > 0
    assert calls["quantize_int8"] == calls["silu_and_mul_quant_int8"]  # o_proj's alone
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(Int8LinearMethod, "int8_input", lambda self, layer: False)
        unfused = tokens("triton")
    assert "add_rms_norm_quant_int8" not in calls and "silu_and_mul_quant_int8" not in calls
    assert calls["quantize_int8"] > 0
    assert fused == unfused == tokens("torch")
