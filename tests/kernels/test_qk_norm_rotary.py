"""The q/k-norm + rotary + KV-write kernel (kiln/kernels/triton/qk_norm_rotary.py) against its
twin, reference.qk_norm_rotary_write_kv: on the CPU under the Triton interpreter at tiny shapes
(fp32, fp16), on a GPU at Qwen3-8B's shape (bf16; bf16 and float8 caches); its LayerNorm
flavour (per-head weights, partial rotary) at tiny shapes and at Command R+'s and StableLM 2
12B's on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.layers.rotary import build_cos_sin_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16


def _inputs(
    num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    # A wider projection output than its rows use: the kernel reads rows by their stride.
    qkv = (3 * torch.randn(num_tokens, width + 8, generator=gen))[:, :width]
    return {
        "qkv": qkv.to(DEVICE, dtype),
        "q_norm_weight": (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype),
        "k_norm_weight": (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(DEVICE, dtype),
        "positions": torch.randint(0, 500, (num_tokens,), generator=gen).to(DEVICE),
        "cos_sin_cache": build_cos_sin_cache(head_dim, 512, 1e6, None).to(DEVICE),
    }


def _caches(
    num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype, head_major: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    def one() -> torch.Tensor:
        if head_major:  # [blocks, heads, block, dim] memory, indexed [blocks, block, heads, dim]
            shape = (num_blocks, kv_heads, BLOCK_SIZE, head_dim)
            return torch.zeros(shape, dtype=dtype, device=DEVICE).transpose(1, 2)
        return torch.zeros(num_blocks, BLOCK_SIZE, kv_heads, head_dim, dtype=dtype, device=DEVICE)

    return one(), one()


def _layer_norm_inputs(
    num_tokens: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int,
    dtype: torch.dtype, seed: int,
) -> dict:  # fmt: skip
    """_inputs for the LayerNorm flavour: a weight row per head, a rotary table of rotary_dim,
    heads offset from zero (the mean the flavour takes out)."""
    args = _inputs(num_tokens, heads, kv_heads, head_dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    args["qkv"] = args["qkv"] + 1.5
    for name, n in (("q_norm_weight", heads), ("k_norm_weight", kv_heads)):
        args[name] = (1 + 0.3 * torch.randn(n, head_dim, generator=gen)).to(DEVICE, dtype)
    args["cos_sin_cache"] = build_cos_sin_cache(rotary_dim, 512, 1e4, None).to(DEVICE)
    args["head_dim"] = head_dim
    args["layer_norm"] = True
    return args


def _run(ops, args: dict, caches: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor):
    flavour = {"layer_norm": True} if args.get("layer_norm") else {}
    return ops.qk_norm_rotary_write_kv(
        args["qkv"], args["q_norm_weight"], args["k_norm_weight"], 1e-6, args["positions"],
        args["cos_sin_cache"], *caches, slots, **flavour,
    )  # fmt: skip


def _compare(
    args: dict, cache_dtype: torch.dtype, head_major: bool, atol: float
) -> tuple[torch.Tensor, torch.Tensor]:  # the reference's caches
    num_tokens = args["qkv"].shape[0]
    kv_heads, head_dim = 2, args.get("head_dim", args["cos_sin_cache"].shape[1])
    num_blocks = (num_tokens + 1) // BLOCK_SIZE + 2
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=torch.Generator().manual_seed(1))
    slots = slots[:num_tokens].to(DEVICE)
    if num_tokens > 1:
        slots[1] = -1  # a padding token: not written
    # The reference skips padding only on the CPU (the check syncs); on CUDA slot -1 lands in
    # the last slot, so its caches get one spare block, left out of the comparison.
    spare = _caches(num_blocks + 1, kv_heads, head_dim, cache_dtype, head_major)
    got_caches = _caches(num_blocks, kv_heads, head_dim, cache_dtype, head_major)
    want = _run(reference, args, spare, slots)
    want_caches = (spare[0][:num_blocks], spare[1][:num_blocks])
    got = _run(triton_ops, args, got_caches, slots)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)
    for g, w in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=atol)
    return want_caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: halves narrower than their lanes
def test_the_kernel_is_its_twin(dtype, head_major, head_dim) -> None:
    args = _inputs(5, heads=4, kv_heads=2, head_dim=head_dim, dtype=dtype, seed=head_dim)
    # fp32: the same arithmetic but for the rsqrt's last bit; fp16: one rounding of the output.
    atol = 1e-5 if dtype == torch.float32 else 4e-3
    _compare(args, dtype, head_major, atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 16), (24, 24), (32, 8), (24, 6)])
def test_the_layer_norm_flavour_is_its_twin(dtype, head_major, head_dim, rotary_dim) -> None:
    """Per-head LayerNorm weights (Cohere's use_qk_norm, StableLM 2 12B's qk_layernorm), with
    full or partial rotary (StableLM's quarter: the passed dims normed, not turned)."""
    args = _layer_norm_inputs(5, 4, 2, head_dim, rotary_dim, dtype, seed=head_dim + rotary_dim)
    atol = 1e-5 if dtype == torch.float32 else 4e-3
    _compare(args, dtype, head_major, atol)
    # The twin is head_layer_norm then rotary (not an RMSNorm, not the weights' first row).
    q, _, _ = reference.split_qkv_heads(args["qkv"], head_dim, 2)
    normed = reference.head_layer_norm(q, args["q_norm_weight"], 1e-6)
    caches = _caches(4, 2, head_dim, dtype, head_major)
    slots = torch.arange(5, device=DEVICE)
    got = _run(triton_ops, args, caches, slots)
    torch.testing.assert_close(
        got[..., rotary_dim:].float(), normed[..., rotary_dim:].float(), rtol=0, atol=atol
    )
    rms = dict(args, layer_norm=False, q_norm_weight=args["q_norm_weight"][0].contiguous(),
               k_norm_weight=args["k_norm_weight"][0].contiguous())  # fmt: skip
    assert (_run(reference, rms, caches, slots) - got).abs().max() > 0.1


def test_partial_rotary_rms_flavour_is_its_twin() -> None:
    """The RMSNorm flavour with a table narrower than head_dim (the same pass-through)."""
    args = _inputs(4, heads=4, kv_heads=2, head_dim=32, dtype=torch.float32, seed=9)
    args["cos_sin_cache"] = build_cos_sin_cache(8, 512, 1e4, None).to(DEVICE)
    args["head_dim"] = 32
    _compare(args, torch.float32, True, 1e-5)


def test_a_float8_cache_saturates_as_the_twin_does() -> None:
    args = _inputs(3, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, seed=3)
    args["k_norm_weight"] = args["k_norm_weight"] * 300  # keys past e4m3's 448
    k_cache, _ = _compare(args, torch.float8_e4m3fn, head_major=True, atol=1e-5)
    assert float(k_cache.float().abs().max()) == 448.0


def test_no_tokens_is_no_launch() -> None:
    args = _inputs(0, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, seed=0)
    caches = _caches(2, 2, 16, torch.float32, False)
    got = _run(triton_ops, args, caches, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert got.shape == (0, 4, 16)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 2048])
def test_qwen3_8b_shape_on_gpu(cache_dtype, num_tokens) -> None:
    """Qwen3-8B's attention: 32 query heads, 8 KV heads, head_dim 128, bf16 activations; the
    reference's arithmetic on the same GPU."""
    args = _inputs(num_tokens, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, seed=8)
    _assert_close_on_gpu(args, num_tokens, 8, 128, cache_dtype)


def _assert_close_on_gpu(args, num_tokens, kv_heads, head_dim, cache_dtype) -> None:
    """The kernel against the reference's arithmetic on the same GPU, bf16 activations."""
    num_blocks = num_tokens // BLOCK_SIZE + 4
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEVICE)[:num_tokens]
    want_caches = _caches(num_blocks, kv_heads, head_dim, cache_dtype, head_major=True)
    got_caches = _caches(num_blocks, kv_heads, head_dim, cache_dtype, head_major=True)
    want = _run(reference, args, want_caches, slots)
    got = _run(triton_ops, args, got_caches, slots)
    # bf16 outputs: the GPU's rsqrt and fused multiply-adds may move a value by one bf16 step.
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    for g, w in zip(got_caches, want_caches, strict=True):
        # float8: one e4m3 step (~6%) where a bf16 step moved a value across a rounding edge.
        rtol = 1.6e-2 if cache_dtype == torch.bfloat16 else 0.13
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=1e-2)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rotary_dim"),
    [(96, 8, 128, 128), (32, 8, 160, 40)],  # Command R+; StableLM 2 12B (a quarter rotated)
)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 2048])
def test_layer_norm_flavour_at_real_shapes_on_gpu(
    heads, kv_heads, head_dim, rotary_dim, cache_dtype, num_tokens
) -> None:
    args = _layer_norm_inputs(
        num_tokens, heads, kv_heads, head_dim, rotary_dim, torch.bfloat16, seed=head_dim
    )
    _assert_close_on_gpu(args, num_tokens, kv_heads, head_dim, cache_dtype)
