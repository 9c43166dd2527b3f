"""Head-major KV cache blocks (kiln.kernels.kv_layout): every cache kiln allocates lies so, since
the Triton kernels read and write no other layout (tests/kernels/test_triton_kernels.py checks
that they refuse one). On the CPU the torch reference indexes the view and runs over any layout,
so these checks are what catches a cache allocated otherwise before a GPU does."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.kv_layout import check_head_major, empty_cache, is_head_major

CPU = torch.device("cpu")


def test_empty_cache_is_a_head_major_view() -> None:
    cache = empty_cache(5, 4, 2, 8, torch.float16, CPU)
    assert cache.shape == (5, 4, 2, 8) and cache.dtype == torch.float16
    assert cache.transpose(1, 2).is_contiguous() and not cache.any()
    assert is_head_major(cache)
    shapes = []

    def allocate(shape, dtype, device):
        shapes.append(shape)
        return torch.ones(shape, dtype=dtype, device=device)

    assert empty_cache(5, 4, 2, 8, torch.float32, CPU, allocate).all()
    assert shapes == [(5, 2, 4, 8)]  # [blocks, KV heads, block_size, head_dim] in memory


def test_a_cache_of_another_layout_is_refused() -> None:
    head_major = empty_cache(5, 4, 2, 8, torch.float32, CPU)
    token_major = torch.zeros(5, 4, 2, 8)
    assert not is_head_major(token_major)
    check_head_major(head_major, head_major)
    for k, v in ((token_major, head_major), (head_major, token_major), (head_major[:, :, :1],) * 2):
        with pytest.raises(ValueError, match="must be head-major"):
            check_head_major(k, v)


def test_the_engine_allocates_head_major_caches(tmp_path) -> None:
    # The runner's cache, the memory profile's scratch cache and a drafter's pool.
    from kiln import LLM
    from kiln.config import EngineConfig
    from kiln.runtime.memory_plan import _largest_step
    from kiln.spec_decode.kv_pool import DraftKVPool
    from tests.conftest import build_tiny_hf_model, tiny_model_config

    path = str(tmp_path / "tiny")
    build_tiny_hf_model("llama-gqa", path)
    llm = LLM(path, block_size=4, kv_cache_memory_gb=0.01)
    caches = llm.engine.executor.runner.kv_caches
    assert all(is_head_major(c) for pair in caches for c in pair)
    llm.shutdown()
    cfg = tiny_model_config("llama")
    step = _largest_step(EngineConfig(max_num_batched_tokens=32), cfg, 64, CPU, torch.float32)
    assert all(is_head_major(c) for pair in step.caches for c in pair)
    pool = DraftKVPool(cfg, 2, 10, 4, torch.float32, CPU)
    assert all(is_head_major(c) for pair in pool.kv_caches for c in pair)
