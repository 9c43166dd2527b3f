"""INT4 (W4A16) and 8-bit weight-only experts over 2 processes on the CPU (gloo): tensor-
parallel experts (each rank every expert's slice, down's inputs in whole groups) and expert
parallelism (whole experts). The oracle is transformers in fp32 on the checkpoint dequantized
exactly: the INT4 checkpoints tests/models/test_moe_int4.py writes (GPTQ, AutoAWQ GEMM,
compressed-tensors; group or per channel; Mixtral's w1 / w2 / w3 names), llm-compressor's
W8A16 and W8A8 INT8 Qwen3-MoE (tests/data/moe_fp8_checkpoints, dequantized as
tests/models/test_moe_w8a16.py does; W8A8's dense projections' inputs rounded per token as
each rank rounds its share: a row-parallel o_proj / down_proj per half), and a fp32 Mixtral
rounded as kiln rounds it at load ("int8-w8a16-g128", "fp8-w8a16-channel"). Greedy tokens
equal over 32 new tokens for the prompts batched (two prefill on the grouped GEMM; decode on
the GEMVs under TP, the grouped GEMM under EP) and for one alone again from the prefix
cache. One engine per case: most of the time is the worker process starting."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln import LLM
from kiln.layers.moe_int4 import Int4MoEMethod
from kiln.layers.moe_w8a16 import W8A16MoEMethod
from tests.layers.test_moe_quantized_parallel import CASES, checkpoint, make_sources
from tests.models.test_moe_int4 import GREEDY, PROMPTS, TOKENS
from tests.models.test_moe_w8a16 import _dequantized, _int8_tokens, rounded_checkpoint
from tests.models.test_qwen3 import hf_greedy_tokens

ENGINE = dict(dtype="float32", device="cpu", num_threads=1, distributed_timeout_s=60,
              block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=4)  # fmt: skip
# (case of tests/layers/test_moe_quantized_parallel.py, expert parallel): each format once or
# more under each mode.
RUNS = [("gptq_g32", False), ("ct", False), ("gptq_channel", False), ("mixtral_awq", False),
        ("awq", True), ("ct_channel", True), ("mixtral_awq", True),
        ("ct_w8a16_g128", False), ("ct_w8a8_int8", False), ("int8_g128", False),
        ("ct_w8a16", True), ("fp8_channel", True)]  # fmt: skip


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return make_sources(tmp_path_factory.mktemp("moe_quantized_gloo"))


def _int8_shares(module: torch.nn.Module, args: tuple) -> tuple:
    """_int8_tokens on each tensor rank's half of a row-parallel projection's input."""
    halves = [_int8_tokens(module, (h,))[0] for h in args[0].chunk(2, dim=-1)]
    return (torch.cat(halves, dim=-1),)


def _rounded(source: Path, quantization: str, out: Path) -> Path:
    """`source` with every projection rounded as quantization=`quantization` rounds it at load."""
    dtype = torch.int8 if quantization.startswith("int8") else torch.float8_e4m3fn
    group = 128 if quantization.endswith("g128") else 0
    return rounded_checkpoint(source, dtype, group, out)


def _oracle(sources: dict[str, Path], case: str, tmp_path: Path) -> list[list[int]]:
    """transformers' greedy tokens on the case's checkpoint dequantized exactly."""
    from transformers import AutoModelForCausalLM

    path, quantization = checkpoint(sources, case)
    family, how, _ = CASES[case]
    if how.startswith("int4:"):
        plain = Path(f"{path}-dequantized")
    elif family == "data":
        plain = _dequantized(Path(path), tmp_path / "dequantized")
    else:
        plain = _rounded(Path(path), quantization, tmp_path / "rounded")
    hf = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    if case == "ct_w8a8_int8":  # the dense projections' inputs per token, a rank's share each
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
                split = name.endswith(("o_proj", "down_proj"))
                module.register_forward_pre_hook(_int8_shares if split else _int8_tokens)
    return [hf_greedy_tokens(hf, p)[:TOKENS] for p in PROMPTS]


@pytest.mark.parametrize(
    ("case", "expert_parallel"), RUNS, ids=[f"{c}-{'ep2' if e else 'tp2'}" for c, e in RUNS]
)
def test_two_ranks_equal_hf_on_the_dequantized_checkpoint(sources, tmp_path, case,
                                                          expert_parallel) -> None:  # fmt: skip
    want = _oracle(sources, case, tmp_path)
    path, quantization = checkpoint(sources, case)
    llm = LLM(path, quantization=quantization, tensor_parallel_size=2,
              enable_expert_parallel=expert_parallel, **ENGINE)  # fmt: skip
    try:
        model = llm.engine.executor.runner.model
        experts = next(layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts"))
        method = Int4MoEMethod if CASES[case][1].startswith("int4:") else W8A16MoEMethod
        assert isinstance(experts.method, method)
        width = 256 if expert_parallel else 128  # every case's experts are 256 wide
        assert (experts.num_experts, experts.intermediate_size) == (
            (2, width) if expert_parallel else (4, width)
        )
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        assert got == want
        hits = llm.engine.kv_cache.stats.hits
        assert list(llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids) == want[0]
        assert llm.engine.kv_cache.stats.hits > hits
    finally:
        llm.shutdown()
