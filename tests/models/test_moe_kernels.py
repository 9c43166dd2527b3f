"""The GPU path of the mixture-of-experts families: one prefill forward of a tiny Qwen2-MoE
checkpoint (routed experts, a dense layer, the shared expert) through the Triton kernels, the
fused-MoE grouped GEMM (27 tokens) or the decode kernels (5 tokens) among them
(TRITON_INTERPRET=1 without a GPU), against the same forward
through the reference ops, which tests/models/test_moe.py holds to transformers; and Qwen3-MoE
and gpt-oss (biased, clamped experts) at decode sizes, where the block's norm and routing run
inside the experts' kernel (one token: the norm inside the router's projection too); GLM-4.5's
sigmoid routing at decode sizes: the router's kernel, then the decode GEMVs unrouted."""

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
from tests.models.test_gpt_oss import TINY_GPT_OSS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _assert_triton_forward_equals_reference(model, lens: list[int], seed: int, ops=triton_ops):
    """One packed prefill of random ids through the reference ops (torch attention) and
    through `ops` (Triton attention): equal logits."""
    cfg = model.config
    metadata, blocks = packed_prefill_metadata(lens, 16, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    outs = []
    for run_ops, backend in ((reference, "torch"), (ops, "triton")):
        shape = (blocks, 16, cfg.num_key_value_heads, cfg.head_dim)
        caches = [
            (empty_cache(*shape, torch.float32, DEVICE), empty_cache(*shape, torch.float32, DEVICE))
            for _ in range(cfg.num_hidden_layers)
        ]
        attention = get_attention_backend(backend, DEVICE)
        with torch.no_grad():
            hidden = model(run_ops, attention, ids.to(DEVICE), positions, caches, metadata)
            outs.append(model.compute_logits(hidden, run_ops).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("lens", [[20, 7], [3, 2]])  # the grouped GEMM; the decode kernels
def test_triton_forward_equals_the_reference(tmp_path, lens) -> None:
    save_tiny_hf(str(tmp_path), "qwen2_moe", "Qwen2MoeForCausalLM",
                 perturb=perturb_norms_and_biases, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48,
                 mlp_only_layers=[1])  # fmt: skip
    model = load_model(EngineConfig(model=str(tmp_path)), DEVICE, torch.float32).model
    assert hasattr(model.layers[0].mlp, "experts") and not hasattr(model.layers[1].mlp, "experts")
    _assert_triton_forward_equals_reference(model, lens, seed=0)


DECODE_FAMILIES = {
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
        head_dim=32)),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM", TINY_GPT_OSS),
}  # fmt: skip


@pytest.mark.parametrize("family", list(DECODE_FAMILIES))
@pytest.mark.parametrize("lens", [[1], [3, 2]])
def test_decode_sizes_route_inside_the_experts_kernel(tmp_path, family, lens) -> None:
    model_type, architecture, overrides = DECODE_FAMILIES[family]
    save_tiny_hf(str(tmp_path), model_type, architecture, perturb=perturb_norms_and_biases,
                 **overrides)  # fmt: skip
    model = load_model(EngineConfig(model=str(tmp_path)), DEVICE, torch.float32).model
    _assert_triton_forward_equals_reference(model, lens, seed=1)


GLM = dict(
    head_dim=32,
    num_hidden_layers=2,
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.0,
)


@pytest.mark.parametrize("lens", [[1], [3, 2]])
def test_sigmoid_routed_decode_takes_the_router_kernel_then_the_gemvs(tmp_path, lens) -> None:
    save_tiny_hf(str(tmp_path), "glm4_moe", "Glm4MoeForCausalLM",
                 perturb=perturb_norms_and_biases, **GLM)  # fmt: skip
    model = load_model(EngineConfig(model=str(tmp_path)), DEVICE, torch.float32).model
    with torch.no_grad():  # a routing bias that changes the choice
        model.layers[1].mlp.experts.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    calls = []

    class Recorded:  # triton_ops, recording which of its functions the forward called
        def __getattr__(self, name):
            fn = getattr(triton_ops, name)
            if not callable(fn):
                return fn
            return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    _assert_triton_forward_equals_reference(model, lens, seed=1, ops=Recorded())
    assert "moe_route" in calls and "fused_moe_decode" in calls
    assert "fused_moe_decode_routed" not in calls  # its in-kernel routing is softmax only
