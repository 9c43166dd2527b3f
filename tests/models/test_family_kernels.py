"""The GPU path of each new family's blocks: one forward of a tiny checkpoint through the Triton
kernels and attention backend (TRITON_INTERPRET=1 without a GPU) against the same forward
through the reference ops, which the HF-equality tests hold to transformers. This covers the
flavours the fused Llama kernels do not take: GeGLU, partial rotary, a q/k norm over the whole
projection, post and sandwich norms, LayerNorm layers, longrope's step table, sigmoid-routed
experts."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.attention.backend import AttentionMetadata, get_attention_backend
from kiln.config import EngineConfig
from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.kv_layout import empty_cache
from kiln.models.packed_prefill import packed_prefill_metadata
from kiln.runtime.model_loader import load_model
from tests.kernels.test_triton_kernels import _head_major
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf
from tests.models.test_phi3 import phi3_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FAMILIES = {
    "gemma": ("GemmaForCausalLM", dict(head_dim=32, hidden_act="gelu_pytorch_tanh")),
    "phi3": ("Phi3ForCausalLM", dict(pad_token_id=0, **phi3_config(16))),
    "olmo2": ("Olmo2ForCausalLM", {}),
    "stablelm": ("StableLmForCausalLM", dict(partial_rotary_factor=0.25, use_qkv_bias=True)),
    "cohere": ("CohereForCausalLM", dict(logit_scale=0.25)),
    "granite": ("GraniteForCausalLM", dict(embedding_multiplier=6.0, residual_multiplier=0.3,
                                           attention_multiplier=0.09, logits_scaling=4.0)),
    # Windows shorter than the 20-token prompt; Gemma 2's soft-caps in the attention kernels.
    "gemma2": ("Gemma2ForCausalLM", dict(head_dim=32, hidden_act="gelu_pytorch_tanh",
                                         sliding_window=5, attn_logit_softcapping=0.5,
                                         final_logit_softcapping=3.0, query_pre_attn_scalar=24)),
    "gemma3_text": ("Gemma3ForCausalLM", dict(head_dim=32, sliding_window=7,
                                              sliding_window_pattern=2, query_pre_attn_scalar=24)),
    "starcoder2": ("Starcoder2ForCausalLM", dict(sliding_window=7)),
    # Sinks, alternating windows, yarn; experts with biases and the clamped SwiGLU.
    "gpt_oss": ("GptOssForCausalLM", dict(head_dim=32, sliding_window=7, num_local_experts=4,
                                          num_experts_per_tok=2, intermediate_size=32,
                                          swiglu_limit=0.6)),
    # DeepSeek-V3's sigmoid routing over 2 groups (the router kernel's SIGMOID variant), an
    # ungated shared expert, q/k norm, q/k/v biases, half-head rotary, a dense first layer.
    "glm4_moe": ("Glm4MoeForCausalLM", dict(head_dim=32, num_hidden_layers=3, n_routed_experts=8,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            n_group=2, topk_group=1, routed_scaling_factor=1.5,
                                            attention_bias=True, use_qk_norm=True)),
    # Multi-head latent attention: one cached [k_pe | c_kv] row of 40 (not a power of two)
    # for 4 query heads, interleaved yarn rotary; DeepSeek-V3's routing as GLM's.
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(num_key_value_heads=4, num_hidden_layers=3,
                                                  q_lora_rank=32, kv_lora_rank=32,
                                                  qk_nope_head_dim=16, qk_rope_head_dim=8,
                                                  v_head_dim=16, n_routed_experts=8,
                                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                                  n_group=2, topk_group=1,
                                                  routed_scaling_factor=1.5,
                                                  rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                "mscale_all_dim": 0.7,
                                                                "original_max_position_embeddings":
                                                                    128})),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_forward_equals_the_reference(family: str, tmp_path) -> None:
    architecture, overrides = FAMILIES[family]
    save_tiny_hf(str(tmp_path), family, architecture, perturb=perturb_norms_and_biases,
                 **overrides)  # fmt: skip
    model = load_model(EngineConfig(model=str(tmp_path)), DEVICE, torch.float32).model
    cfg = model.config
    lens = [20, 7]  # two prompts of one prefill step; the first past phi3's threshold of 16
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
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)


class _Calls:
    """An ops module that records which of its functions a forward called (and with an
    x_norm_weight), passing every call through."""

    def __init__(self, ops: object) -> None:
        self._ops, self.calls, self.x_normed = ops, [], []

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._ops, name)
        if not callable(fn):
            return fn

        def call(*args: object, **kwargs: object) -> object:
            self.calls.append(name)
            bound = inspect.signature(fn).bind(*args, **kwargs).arguments
            if bound.get("x_norm_weight") is not None:
                self.x_normed.append(name)
            return fn(*args, **kwargs)

        return call


def _unfused_sandwich_forward(model, ops, backend, ids, positions, caches, metadata):
    """The sandwich layers as written out unfused: each block's output RMS-normed by its own
    op before the residual add (what the fused entries' x_norm_weight replaces)."""
    step = model.step_inputs(ops, backend, positions, metadata)
    hidden, residual = model.embed(ids), None
    for layer, kv_cache in zip(model.layers, caches):
        eps, attn = layer.eps, layer.self_attn
        summed = hidden if residual is None else hidden + residual
        normed = ops.rms_norm(summed, layer.input_layernorm, eps)
        query, _ = attn.project_qkv(step, normed, None, None, eps, kv_cache)
        attended = ops.rms_norm(attn.attend(step, query, kv_cache), layer.post_attention_layernorm,
                                eps)  # fmt: skip
        summed = attended + summed
        mlp_out, _ = layer.mlp(ops, ops.rms_norm(summed, layer.pre_feedforward_layernorm, eps),
                               None, None, eps)  # fmt: skip
        hidden, residual = ops.rms_norm(mlp_out, layer.post_feedforward_layernorm, eps), summed
    return ops.fused_add_rms_norm(hidden, residual, model.norm, model.config.rms_norm_eps)[0]


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
@pytest.mark.parametrize("quantization", ["none", "fp8-dynamic"])
def test_sandwich_decode_fused_equals_unfused(family: str, quantization: str, tmp_path) -> None:
    """One batch-1 decode step of a sandwich-norm model through the Triton kernels (the fused
    one-row entries: each block's output norm inside the next entry, GeGLU inside the gate_up
    kernel; no RMSNorm of its own but the final one) against the layers written out unfused
    over the reference ops. FP8: within the float8 rounding a last-bit difference can flip."""
    architecture, overrides = FAMILIES[family]
    save_tiny_hf(str(tmp_path), family, architecture, perturb=perturb_norms_and_biases,
                 **overrides)  # fmt: skip
    config = EngineConfig(model=str(tmp_path), quantization=quantization)
    model = load_model(config, DEVICE, torch.float32).model
    cfg = model.config
    context = 12  # past gemma2's window of 5 and gemma3's 7
    gen = torch.Generator().manual_seed(1)
    shape = (2, 8, cfg.num_key_value_heads, cfg.head_dim)
    caches = [tuple(torch.randn(shape, generator=gen) for _ in "kv")
              for _ in range(cfg.num_hidden_layers)]  # fmt: skip
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([context - 1], device=DEVICE),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([context], dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE),
        num_decodes=1, max_query_len=1, max_seq_len=context,
    )  # fmt: skip
    ids = torch.tensor([17], device=DEVICE)
    positions = torch.tensor([context - 1], device=DEVICE)

    def on_device() -> list[tuple[torch.Tensor, ...]]:
        return [tuple(_head_major(c).to(DEVICE) for c in pair) for pair in caches]

    fused_ops = _Calls(triton_ops)
    with torch.no_grad():
        want = _unfused_sandwich_forward(model, reference, get_attention_backend("torch", DEVICE),
                                         ids, positions, on_device(), metadata)  # fmt: skip
        got = model(fused_ops, get_attention_backend("triton", DEVICE), ids, positions,
                    on_device(), metadata)  # fmt: skip
    scale = float(want.abs().max())
    tol = 2e-4 if quantization == "none" else 5e-2
    torch.testing.assert_close(got, want, rtol=0, atol=tol * scale)
    assert fused_ops.calls.count("rms_norm") == 0, fused_ops.calls
    gated = "add_rms_norm_linear_silu_mul" + ("_fp8" if quantization != "none" else "")
    entry = "add_rms_norm_linear" if family == "gemma3_text" else "add_rms_norm_qkv_rotary_write_kv"
    layers = cfg.num_hidden_layers
    assert fused_ops.x_normed == [gated, *[entry, gated] * (layers - 1), "fused_add_rms_norm"]
