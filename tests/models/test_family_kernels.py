"""The GPU path of each new family's blocks: one forward of a tiny checkpoint through the Triton
kernels and attention backend (TRITON_INTERPRET=1 without a GPU) against the same forward
through the reference ops, which the HF-equality tests hold to transformers. This covers the
flavours the fused Llama kernels do not take: GeGLU, partial rotary, a q/k norm over the whole
projection, post and sandwich norms, LayerNorm layers, longrope's step table."""

from __future__ import annotations

import os

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
