"""Head-major KV cache blocks (kiln.kernels.kv_layout, KILN_KV_CACHE_LAYOUT=head) against the
default token-major ones: every op that writes or reads the cache (the KV writes of a prompt and
of a one-row decode step, prefill and decode attention, block copies), in the Triton kernels and
the torch reference, gives the same bits over either layout, and so does the engine.

Without CUDA the Triton kernels run under the interpreter at tiny shapes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

from kiln.attention.backend import AttentionMetadata
from kiln.attention.torch_backend import TorchAttentionBackend
from kiln.envs import envs
from kiln.kernels import reference
from kiln.kernels.kv_layout import empty_cache, head_major, kv_cache_head_major

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn


def _caches(num_layers, num_blocks, block_size, cfg, dtype, head_major_layout):
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)

    def zeros(shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)

    return [
        tuple(empty_cache(*shape, dtype, DEVICE, head_major_layout, zeros) for _ in "kv")
        for _ in range(num_layers)
    ]


def _bits(cache: torch.Tensor) -> torch.Tensor:
    return cache.contiguous().view(torch.uint8) if cache.element_size() == 1 else cache


def _steps(model, ops, backend, caches, prompt_len: int, block_size: int):
    """A prompt of `prompt_len` tokens over two sequences (one whole, one in two chunks after a
    cached prefix), then one decode step of both: the logits of each step."""
    gen = torch.Generator().manual_seed(4)
    vocab = model.config.vocab_size
    blocks = -(-(prompt_len + 1) // block_size)
    tables = torch.arange(2 * blocks, dtype=torch.int32, device=DEVICE).view(2, blocks)
    tables = tables.flip(0).contiguous()  # the second sequence in the lower blocks

    def slots(seq: int, positions: range) -> list[int]:
        return [int(tables[seq, p // block_size]) * block_size + p % block_size for p in positions]

    def step(chunks: list[tuple[int, range]], num_decodes: int) -> torch.Tensor:
        ids = torch.randint(0, vocab, (sum(len(r) for _, r in chunks),), generator=gen)
        positions = torch.tensor([p for _, r in chunks for p in r])
        starts = [0]
        for _, r in chunks:
            starts.append(starts[-1] + len(r))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor([s for seq, r in chunks for s in slots(seq, r)]).to(DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([r.stop for _, r in chunks], dtype=torch.int32, device=DEVICE),
            block_tables=tables[[seq for seq, _ in chunks]].contiguous(),
            num_decodes=num_decodes,
            max_query_len=max(len(r) for _, r in chunks),
            max_seq_len=max(r.stop for _, r in chunks),
        )
        with torch.no_grad():
            return model(ops, backend, ids.to(DEVICE), positions.to(DEVICE), caches, metadata)

    half = prompt_len // 2
    return [
        step([(0, range(prompt_len)), (1, range(half))], 0),
        step([(1, range(half, prompt_len))], 0),
        step([(0, range(prompt_len, prompt_len + 1)), (1, range(prompt_len, prompt_len + 1))], 2),
        step([(1, range(prompt_len + 1, prompt_len + 2))], 1),  # one row: the fused qkv kernel
    ]


class _Launches:
    """Stands in for a @triton.jit kernel and counts its launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8], ids=["fp32-cache", "fp8-cache"])
@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_layouts_give_the_same_bits(monkeypatch, cache_dtype: torch.dtype, kernels: str) -> None:
    pytest.importorskip("triton")
    from kiln.attention.triton_backend import TritonAttentionBackend
    from kiln.kernels import triton as triton_ops
    from kiln.kernels.triton import decode_attention, prefill_attention, qkv_rotary, rotary
    from kiln.models.llama import LlamaForCausalLM
    from tests.conftest import tiny_model_config

    # Every Triton kernel that writes or reads the cache runs (not a fallback).
    launches = {}
    for module, name in (
        (qkv_rotary, "_qkv_rotary_write_kv_kernel"),
        (rotary, "_rotary_write_kv_kernel"),
        (prefill_attention, "_prefill_kernel"),
        (decode_attention, "_decode_packed_kernel" if cache_dtype == FP8 else "_decode_kernel"),
    ):
        launches[name] = _Launches(getattr(module, name))
        monkeypatch.setattr(module, name, launches[name])

    cfg = tiny_model_config("llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_positions=64).to(DEVICE)
    model.init_dummy_weights(seed=5)
    ops, backend = (
        (triton_ops, TritonAttentionBackend())
        if kernels == "triton"
        else (reference, TorchAttentionBackend())
    )
    block_size, prompt_len = 4, 13
    results = {}
    for layout in (False, True):
        caches = _caches(cfg.num_hidden_layers, 10, block_size, cfg, cache_dtype, layout)
        assert head_major(*caches[0]) is layout
        logits = _steps(model, ops, backend, caches, prompt_len, block_size)
        results[layout] = logits, caches
    (token_logits, token_caches), (head_logits, head_caches) = results[False], results[True]
    for a, b in zip(token_logits, head_logits):
        assert torch.equal(a, b)
    for pair_a, pair_b in zip(token_caches, head_caches):
        for a, b in zip(pair_a, pair_b):
            assert torch.equal(_bits(a), _bits(b))
            assert _bits(a).any()
    if kernels == "triton":
        assert all(launched.count for launched in launches.values()), {
            name: launched.count for name, launched in launches.items()
        }


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_block_copies_over_head_major_blocks(kernels: str) -> None:
    # A block's bytes stay together in either layout, so a copy moves the same values.
    pytest.importorskip("triton")
    from kiln.kernels import triton as triton_ops

    ops = triton_ops if kernels == "triton" else reference
    gen = torch.Generator().manual_seed(6)
    values = [torch.randn(5, 4, 2, 8, generator=gen).to(DEVICE, torch.float16) for _ in "kv"]
    token_major = [v.clone() for v in values]
    head_major_caches = [v.transpose(1, 2).contiguous().transpose(1, 2) for v in values]
    mapping = torch.tensor([[0, 3], [2, 4]], dtype=torch.int64, device=DEVICE)
    ops.copy_kv_blocks(token_major, mapping)
    ops.copy_kv_blocks(head_major_caches, mapping)
    for a, b in zip(token_major, head_major_caches):
        assert torch.equal(a, b)
        assert torch.equal(a[3], a[0]) and torch.equal(a[4], a[2])


def test_the_engine_generates_the_same_tokens_over_either_layout(tmp_path, monkeypatch) -> None:
    # The runner allocates head-major caches by default and token-major ones under
    # KILN_KV_CACHE_LAYOUT=token; greedy tokens (chunked prompts, a shared prefix from the
    # cache, decode) are the same over both.
    from kiln import LLM, SamplingParams
    from tests.conftest import build_tiny_hf_model

    path = str(tmp_path / "tiny")
    build_tiny_hf_model("llama-gqa", path)
    prompts = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 2, 9, 1, 5], [5, 9, 2, 7, 1, 3, 8, 4, 11, 12]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def generate() -> tuple[list[list[int]], bool]:
        llm = LLM(path, max_num_batched_tokens=8, block_size=4, kv_cache_memory_gb=0.01)
        caches = llm.engine.executor.runner.kv_caches
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [o.outputs[0].token_ids for o in outs], head_major(*caches[0])

    assert kv_cache_head_major()  # the default
    want, layout = generate()
    assert layout is True
    monkeypatch.setenv("KILN_KV_CACHE_LAYOUT", "token")
    envs.cache_clear()
    try:
        assert not kv_cache_head_major()
        got, layout = generate()
    finally:
        monkeypatch.delenv("KILN_KV_CACHE_LAYOUT")
        envs.cache_clear()
    assert layout is False
    assert got == want


def test_an_unknown_layout_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("KILN_KV_CACHE_LAYOUT", "heads")
    envs.cache_clear()
    try:
        with pytest.raises(ValueError, match="KILN_KV_CACHE_LAYOUT='heads'"):
            kv_cache_head_major()
    finally:
        monkeypatch.delenv("KILN_KV_CACHE_LAYOUT")
        envs.cache_clear()
