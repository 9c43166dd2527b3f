"""The decode roofline's bytes (kiln.bench.roofline): a mixture-of-experts step reads the experts
its tokens pick, not all of them; a dense model reads every weight. Numbers from the presets."""

from __future__ import annotations

import pytest
import torch

from kiln.bench.roofline import decode_step_bytes, expected_distinct_experts
from kiln.models.config import PRESETS, ModelConfig
from kiln.runtime.config_plan import weight_bytes


def test_expected_distinct_experts() -> None:
    assert expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2)
    # Two tokens over 8 experts, top-2: 8 * (1 - (3/4)^2) = 3.5 (overlap is likely).
    assert expected_distinct_experts(8, 2, 2) == pytest.approx(3.5)
    assert expected_distinct_experts(128, 8, 4096) == pytest.approx(128)


def _fp8_qwen3_moe(batch: int) -> tuple[ModelConfig, int, int, object]:
    cfg = ModelConfig.from_hf_dict(PRESETS["qwen3-30b-a3b"])
    total = weight_bytes(cfg, torch.bfloat16, "fp8-dynamic")
    layers, e = cfg.num_hidden_layers, cfg.num_experts
    experts = layers * e * (3 * cfg.hidden_size * cfg.moe_intermediate_size + 2 * 4)
    embedding = cfg.vocab_size * cfg.hidden_size * 2
    return cfg, total, experts, decode_step_bytes(cfg, total, experts, embedding, 5e7, batch)


def test_qwen3_30b_a3b_batch_1_reads_its_8_active_experts() -> None:
    cfg, total, experts, step = _fp8_qwen3_moe(1)
    # The model card: 30.5B parameters, 3.3B active (embeddings and LM head included).
    assert step.total_parameters == pytest.approx(30.5e9, rel=0.01)
    assert step.active_parameters == pytest.approx(3.35e9, rel=0.02)
    assert step.experts_per_layer == pytest.approx(8)
    assert step.expert_bytes == pytest.approx(experts * 8 / 128)
    assert step.expert_bytes == pytest.approx(1.81e9, rel=0.01)  # 48 x 8 x 3 x 2048 x 768 B
    # Attention (float8) + the bf16 LM head and routers, the embedding table left out.
    assert step.non_expert_bytes == pytest.approx(1.56e9, rel=0.02)
    assert step.total_bytes == pytest.approx(step.non_expert_bytes + step.expert_bytes + 5e7)
    assert step.total_bytes < 0.3 * (total - cfg.vocab_size * cfg.hidden_size * 2)


def test_a_batch_reads_more_experts_up_to_all() -> None:
    one, eight, huge = (_fp8_qwen3_moe(b)[3] for b in (1, 8, 10_000))
    assert one.expert_bytes < eight.expert_bytes < huge.expert_bytes
    _, _, experts, _ = _fp8_qwen3_moe(1)
    assert huge.expert_bytes == pytest.approx(experts)
    assert eight.active_parameters == one.active_parameters  # per token, whatever the batch


def test_a_dense_model_reads_every_weight() -> None:
    cfg = ModelConfig.from_hf_dict(PRESETS["llama-3.1-8b"])
    total = weight_bytes(cfg, torch.bfloat16, "none")
    step = decode_step_bytes(cfg, total, 0, 1000, 10.0, batch=1)
    assert step.experts_per_layer == 0 and step.expert_bytes == 0
    assert step.non_expert_bytes == total - 1000 and step.total_bytes == total - 990
    assert step.active_parameters == step.total_parameters == pytest.approx(8.0e9, rel=0.01)


def test_bench_latency_on_a_mixture_of_experts_counts_its_active_experts(tmp_path) -> None:
    """`kiln bench latency` on a tiny Qwen3-MoE (4 experts, top-2, every layer sparse): the
    record's roofline reads 2 of 4 experts a layer, and names the active parameters."""
    import json

    from kiln.cli.main import main
    from tests.models.family_checks import save_tiny_hf

    src = str(tmp_path / "moe")
    save_tiny_hf(src, "qwen3_moe", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, head_dim=32, norm_topk_prob=True)  # fmt: skip
    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--model", src, "--num-requests", "1", "--input-len", "8",
            "--output-len", "4", "--warmup", "0", "--no-progress",
            "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    record = json.loads(out.read_text())
    roofline, plan = record["roofline"], record["memory_plan"]
    assert roofline["experts_per_layer"] == pytest.approx(2)
    assert roofline["active_parameters"] < roofline["total_parameters"]
    expert_bytes = roofline["expert_bytes"]
    assert expert_bytes == pytest.approx(plan["expert_weight_gib"] * 2**30 / 2)
    assert expert_bytes > 0 and roofline["bytes_per_step"] == pytest.approx(
        roofline["non_expert_bytes"] + expert_bytes + roofline["kv_bytes"]
    )
    # Half the experts' bytes (2 of 4), the other half not counted: below the weights' total.
    assert roofline["bytes_per_step"] < plan["weight_gib"] * 2**30 + roofline["kv_bytes"]
