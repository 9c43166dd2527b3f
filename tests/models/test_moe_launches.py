"""What a batch-1 decode step launches per decoder layer (tests/models/launch_count.py: the
Triton kernels under the interpreter, the torch ops between them), FP8 dynamic weights and a
float8 KV cache as the published rows run: a Qwen3-MoE layer one launch more than a dense
Qwen3 layer (its router's projection, with the post-attention norm inside; the norm again and
the softmax/top-k inside the experts' first kernel), gpt-oss's biased, clamped experts and
block-FP8 experts on the same two decode kernels, Qwen2-MoE's shared expert three launches more,
no torch op launching a kernel of its own in any, and a dense Llama layer's five launches as
they were."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.config import EngineConfig
from kiln.runtime.model_loader import load_model
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf
from tests.models.launch_count import LayerLaunches, decode_step_launches
from tests.models.test_gpt_oss import TINY_GPT_OSS

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="counts interpreted launches")

FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM", {}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(head_dim=32)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        head_dim=32)),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM", TINY_GPT_OSS),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
        shared_expert_intermediate_size=48)),
}  # fmt: skip
QUANTIZATION = {"qwen3_moe_fp8_block": ("qwen3_moe", "fp8-block")}  # another method, a family's


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, list[LayerLaunches]]:
    out = {}
    cases = {family: (family, "fp8-dynamic") for family in FAMILIES} | QUANTIZATION
    for case, (family, quantization) in cases.items():
        model_type, architecture, overrides = FAMILIES[family]
        path = str(tmp_path_factory.mktemp(case))
        save_tiny_hf(path, model_type, architecture, perturb=perturb_norms_and_biases,
                     **overrides)  # fmt: skip
        config = EngineConfig(model=path, quantization=quantization, kv_cache_dtype="fp8")
        model = load_model(config, torch.device("cpu"), torch.float16).model
        out[case] = decode_step_launches(model, torch.float8_e4m3fn)
    return out


def test_no_torch_op_launches_a_kernel_in_a_decode_layer(launches) -> None:
    for family, layers in launches.items():
        for layer in layers:
            assert layer.torch_ops == [], (family, layer.torch_ops)


def test_a_moe_layer_is_one_launch_more_than_a_dense_one(launches) -> None:
    dense, moe = launches["qwen3"][-1], launches["qwen3_moe"][-1]
    assert moe.kernels == dense.kernels + 1 == 7, moe.triton
    assert moe.triton[-2:] == ["_gate_up_act_kernel", "_down_sum_kernel"]
    assert "_route_kernel" not in moe.triton and "_rms_norm_kernel" not in moe.triton


def test_block_fp8_experts_route_inside_the_decode_kernels(launches) -> None:
    """fp8-block: the experts' block scales on the same two routed decode launches."""
    for layer in launches["qwen3_moe_fp8_block"]:
        assert layer.triton[-2:] == ["_gate_up_act_kernel", "_down_sum_kernel"], layer.triton
        assert "_route_kernel" not in layer.triton, layer.triton


def test_gpt_oss_experts_take_the_decode_kernels(launches) -> None:
    for layer in launches["gpt_oss"]:
        assert layer.triton[-2:] == ["_gate_up_act_kernel", "_down_sum_kernel"], layer.triton
        assert layer.kernels == 6


def test_the_shared_expert_adds_three_launches(launches) -> None:
    """Qwen2-MoE: its norm + gate_up + SiLU-mul, its down and its gate's projection; the
    sigmoid-gated sum inside the experts' last kernel."""
    for layer in launches["qwen2_moe"]:
        assert layer.kernels == 3 + 3 + 3, layer.triton  # attention, router + experts, shared


def test_a_dense_llama_layer_launches_as_before(launches) -> None:
    for layer in launches["llama"]:
        assert layer.kernels == 5, layer.triton
