"""The memory plan from the config alone (kiln.runtime.config_plan), checked by hand: the
Llama-3.1-8B preset with FP8 weights and a float8 cache on a 141 GiB card, a tiny config on the
CPU, and the line the engine logs before it reads any weight."""

from __future__ import annotations

import logging

import torch

from kiln.config import EngineConfig
from kiln.models.config import PRESETS, ModelConfig
from kiln.runtime.config_plan import plan_from_config

GiB = 1 << 30


def test_llama_8b_fp8_plan_by_hand() -> None:
    cfg = ModelConfig.from_hf_dict(PRESETS["llama-3.1-8b"])
    config = EngineConfig(
        model="llama-3.1-8b", quantization="fp8", kv_cache_dtype="fp8",
        max_num_batched_tokens=16384, max_num_seqs=84, gpu_memory_utilization=0.95,
    )  # fmt: skip
    plan = plan_from_config(cfg, config, 131072, torch.bfloat16, torch.float8_e4m3fn, 141 * GiB)
    # KV: K and V x 32 layers x 8 KV heads x 128 dims x 1 byte.
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 == 64 * 1024
    # Weights: per layer qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672, down 14336 x 4096
    # at one byte, a float32 scale per output channel; 65 norms and two 128256 x 4096
    # embeddings in bf16.
    per_layer = 4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096
    assert per_layer == 218_103_808
    scales = 32 * (6144 + 4096 + 28672 + 4096) * 4
    weights = 32 * per_layer + scales + 65 * 4096 * 2 + 2 * 128256 * 4096 * 2
    assert plan.weight_bytes == weights == 9_086_705_664  # 8.46 GiB
    # Activations: 16384 tokens x (3 x 4096 + 2 x 4096 + 2 x 1024 + 3 x 14336) bf16 values,
    # and three fp32 vocabulary rows for each of 84 sequences.
    activations = 16384 * (3 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336) * 2 + 3 * 84 * 128256 * 4
    assert plan.activation_bytes == activations
    budget = int(141 * GiB * 0.95) - weights - activations - (GiB // 2 + 256 * (1 << 20))
    assert plan.kv_budget_bytes == budget
    blocks = budget // (64 * 1024 * 16)
    assert plan.kv_tokens == blocks * 16 == 2_008_944  # ~122.6 GiB of float8 KV
    # 4k: 256 blocks a sequence; 32k: 2048; 128k: 8192.
    assert [plan.sequences_of(n) for n in (4096, 32768, 131072)] == [490, 61, 15]
    assert plan.sequences_of(22000) == blocks // 1375 == 91  # the 20000/2000 row's length
    text = plan.describe()
    assert "490 x 4096, 61 x 32768, 15 x 131072" in text and "8.46 GiB" in text


def test_tiny_config_on_the_cpu() -> None:
    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 8192,
        }
    )  # fmt: skip
    config = EngineConfig(model="x", kv_cache_memory_gb=0.001)
    plan = plan_from_config(cfg, config, 8192, torch.float32, torch.float32, None)
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    assert plan.kv_budget_bytes == int(0.001 * GiB) == 1_073_741
    assert plan.kv_tokens == 1_073_741 // (512 * 16) * 16 == 2096
    assert plan.lengths() == [4096, 8192]
    assert [plan.sequences_of(4096), plan.sequences_of(8192)] == [0, 0]
    small = plan_from_config(cfg, config, 1000, torch.float32, torch.float32, None)
    assert small.lengths() == [1000] and small.sequences_of(1000) == 2  # 63 blocks each
    # fp32 weights: 2 layers x (64 x 128 + 64 x 64 + 64 x 256 + 128 x 64), 5 norms, 2 tables.
    linear = 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64)
    assert plan.weight_bytes == (linear + 5 * 64 + 2 * 256 * 64) * 4
    assert plan.activation_bytes == 0  # the CPU's budget is a fixed size


def test_the_engine_logs_the_plan_before_loading(tmp_path, caplog) -> None:
    from kiln import LLM
    from tests.models.family_checks import save_tiny_hf

    save_tiny_hf(str(tmp_path), "llama", "LlamaForCausalLM")
    with caplog.at_level(logging.INFO, logger="kiln.startup"):
        LLM(str(tmp_path), max_model_len=64, kv_cache_memory_gb=0.01, enforce_eager=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "kiln.startup"]
    first = next(i for i, line in enumerate(lines) if "before loading (cpu)" in line)
    assert "sequences at once" in lines[first] and "x 64" in lines[first]
    assert first < next(i for i, line in enumerate(lines) if line.startswith("model:"))


def test_gemma3_12b_counts_its_windowed_layers_at_the_window() -> None:
    """Gemma-3-12B (40 layers of window 1024, 8 global) with FP8 weights and a float8 cache on
    a 141 GiB card: its windowed layers hold a window of a long sequence, not the whole of it,
    so several times more 32k and 128k sequences fit than counting every layer fully."""
    cfg = ModelConfig.from_hf_dict(PRESETS["gemma-3-12b"])
    config = EngineConfig(
        model="gemma-3-12b", quantization="fp8", kv_cache_dtype="fp8",
        max_num_batched_tokens=8192, max_num_seqs=256, gpu_memory_utilization=0.9,
    )  # fmt: skip
    plan = plan_from_config(cfg, config, 131072, torch.bfloat16, torch.float8_e4m3fn, 141 * GiB)
    assert plan.kv_bytes_per_token == 2 * 48 * 8 * 256  # every layer, as before
    # A pool block holds 8 layers (a group's: kiln.models.kv_groups), 16 tokens each.
    assert plan.kv_bytes_per_block == 2 * 8 * 8 * 256 * 16
    blocks = plan.kv_budget_bytes // plan.kv_bytes_per_block
    step = 5 * 8192 // 16  # room for one step's tokens in each windowed group
    # A sequence: its whole context in the full group, 1023 + 32 tokens in each of five.
    for length, windowed in ((4096, 5 * 66), (32768, 5 * 66), (131072, 5 * 66)):
        assert plan.sequences_of(length) == (blocks - step) // (length // 16 + windowed)
    counted_fully = [plan.sequences_keeping_every_layer(n) for n in (4096, 32768, 131072)]
    fits = [plan.sequences_of(n) for n in (4096, 32768, 131072)]
    assert counted_fully == [149, 18, 4] and fits == [388, 95, 26]
    text = plan.describe()
    assert "388 x 4096, 95 x 32768, 26 x 131072" in text
    assert "every layer's whole context would hold 149 x 4096, 18 x 32768, 4 x 131072" in text
