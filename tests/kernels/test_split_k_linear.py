"""Split-K in the small-batch linear kernels (kiln/kernels/triton/split_k.py): forced split
factors against the pure-PyTorch twins, under the interpreter at tiny shapes (K a multiple of
neither the split nor the tile), and on a GPU at Llama-3.1-8B's shapes, in CUDA graphs too.

The twins are unchanged by split-K: these are the same reference comparisons as
test_fp8_linear's and test_triton_kernels', with every launch cut over K."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.kv_layout import empty_cache
from kiln.kernels.triton import small_batch_tiles, split_k
from kiln.kernels.triton.small_batch_tiles import Tiles
from tests.layers.test_fp8_linear import _fp8_inputs as inputs
from tests.layers.test_fp8_linear import _no_unfused_path as no_unfused_path

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
on_gpu = pytest.mark.skipif(INTERPRET, reason="needs a CUDA GPU (interpreter run)")
REL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# K = 136 over the interpreter's 32-wide steps (4.25 of them): 2 splits of 96 + 40, 3 of
# 64 + 64 + 8, and 8 asked gives 5 launched (a split past K is not launched); where stats_block
# says so, the first pass over the input row in 64-wide steps, not the stream's 32.
K, N = 136, 48
FP32, FP16 = torch.float32, torch.float16


def force_tiles(
    monkeypatch: pytest.MonkeyPatch, split: int, stats_block: int = 0, block_k: int | None = 32
) -> list:
    """Every small-batch launch gets its default tiles cut `split` ways, in block_k steps (32:
    the interpreter's, and what makes a tiny K split on a GPU too; None: the default's); returns
    the kernels the launches asked tiles for."""
    asked, default = [], small_batch_tiles.tile_config

    def forced(kernel: str, *args: object, **kwargs: object) -> Tiles:
        asked.append(kernel)
        tiles = default(kernel, *args, **kwargs)._replace(split_k=split, stats_block=stats_block)
        return tiles if block_k is None else tiles._replace(block_k=block_k)

    monkeypatch.setattr(small_batch_tiles, "tile_config", forced)
    return asked


def on(*tensors):
    return [t.to(DEVICE) if t is not None else None for t in tensors]


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(
        got.cpu().float(), want.float(), rtol=0, atol=REL[dtype] * float(want.abs().max())
    )


def assert_counters_zero() -> None:
    """Every launch leaves its tile counters at zero for the next one."""
    assert int(split_k.counters(DEVICE).abs().sum()) == 0


@pytest.mark.parametrize(
    ("split", "static", "dtype"), [(2, False, FP32), (3, True, FP16), (8, False, FP16)]
)
def test_split_k_fp8_linear(monkeypatch, split, static, dtype) -> None:
    """One row quantized in the kernel (its absmax pass in 64-wide steps), and 5 rows quantized
    by quantize_fp8 first, cut over K: reference.fp8_linear's products and scales."""
    for rows in (1, 5):
        x, _, _, w_fp8, w_scale, bias = inputs(rows, K, N, dtype, seed=rows + split)
        input_scale = torch.tensor(x.float().abs().max().item() / 300) if static else None
        want = reference.fp8_linear(x, w_fp8, w_scale, input_scale, bias)
        force_tiles(monkeypatch, split, stats_block=64)
        no_unfused_path(monkeypatch)
        got = triton_ops.fp8_linear(*on(x, w_fp8, w_scale, input_scale, bias))
        assert_close(got, want, dtype)
        assert_counters_zero()


@pytest.mark.parametrize(
    ("split", "static", "with_residual", "dtype"),
    [(2, False, True, FP32), (3, True, False, FP16), (8, False, False, FP32)],
)
def test_split_k_fp8_norm_linear_and_silu_mul(
    monkeypatch, split, static, with_residual, dtype
) -> None:
    """One row, the residual add and RMSNorm fused before the cut stream: the residual stream
    exact, the projection and SiLU-mul as the reference's."""
    x, residual, norm_weight, w_fp8, w_scale, bias = inputs(1, K, N, dtype, seed=split)
    residual = residual if with_residual else None
    input_scale = torch.tensor(0.02) if static else None  # some normed values saturate
    want, want_sum = reference.add_rms_norm_linear(
        x, residual, norm_weight, 1e-5, w_fp8, bias, w_scale, input_scale
    )
    want_act, _ = reference.add_rms_norm_linear_silu_mul(
        x, residual, norm_weight, 1e-5, w_fp8, w_scale, input_scale
    )
    asked = force_tiles(monkeypatch, split)
    no_unfused_path(monkeypatch)
    args, scales = on(x, residual, norm_weight), on(w_scale, input_scale)
    got, got_sum = triton_ops.add_rms_norm_linear(*args, 1e-5, *on(w_fp8, bias), *scales)
    got_act, got_act_sum = triton_ops.add_rms_norm_linear_silu_mul(
        *args, 1e-5, w_fp8.to(DEVICE), *scales
    )
    assert asked == ["norm_linear", "norm_linear_silu_mul"]
    assert torch.equal(got_sum.cpu(), want_sum) and torch.equal(got_act_sum.cpu(), want_sum)
    assert_close(got, want, dtype)
    assert_close(got_act, want_act, dtype)
    assert_counters_zero()


@pytest.mark.parametrize("split", [3])
def test_split_k_gated_rows_after_the_norm_kernel(monkeypatch, split) -> None:
    """3 rows: the norm kernel, quantize_fp8, then the plain gated kernel cut over K."""
    x, residual, norm_weight, w_fp8, w_scale, _ = inputs(3, K, N, torch.float32, seed=7)
    want, _ = reference.add_rms_norm_linear_silu_mul(
        x, residual, norm_weight, 1e-5, w_fp8, w_scale, None
    )
    asked = force_tiles(monkeypatch, split)
    got, _ = triton_ops.add_rms_norm_linear_silu_mul(
        *on(x, residual, norm_weight), 1e-5, *on(w_fp8, w_scale), None
    )
    assert asked == ["linear_silu_mul"]
    assert_close(got, want, torch.float32)
    assert_counters_zero()


@pytest.mark.parametrize(("split", "static"), [(2, False), (8, True)])
def test_split_k_fp8_qkv_rotary_write_kv(monkeypatch, split, static) -> None:
    """The attention block's one-row kernel cut over K: the rotation and the cache writes run on
    the summed pairs, in the program that arrives last."""
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    n = (num_heads + 2 * num_kv_heads) * head_dim
    x, residual, norm_weight, w_fp8, w_scale, bias = inputs(1, K, n, torch.float32, 11 + split)
    input_scale = torch.tensor(0.01) if static else None
    half = torch.arange(head_dim // 2, dtype=torch.float32)
    freqs = torch.arange(64, dtype=torch.float32)[:, None] / (10000 ** (2 * half / head_dim))
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions, slots = torch.tensor([21]), torch.tensor([5])
    caches = [
        empty_cache(3, 4, num_kv_heads, head_dim, torch.float32, torch.device("cpu")) for _ in "kv"
    ]
    want_q, want_sum = reference.add_rms_norm_qkv_rotary_write_kv(
        x, residual, norm_weight, 1e-5, w_fp8, bias, positions, cos_sin, *caches, slots,
        w_scale, input_scale,
    )  # fmt: skip
    got_caches = [torch.zeros_like(c).to(DEVICE) for c in caches]
    asked = force_tiles(monkeypatch, split, stats_block=64)
    no_unfused_path(monkeypatch)
    got_q, got_sum = triton_ops.add_rms_norm_qkv_rotary_write_kv(
        *on(x, residual, norm_weight), 1e-5, *on(w_fp8, bias, positions, cos_sin),
        *got_caches, slots.to(DEVICE), *on(w_scale, input_scale),
    )  # fmt: skip
    assert asked == ["qkv_rotary"]
    assert torch.equal(got_sum.cpu(), want_sum)
    for g, w in ((got_q, want_q), *zip(got_caches, caches)):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=1e-5 * float(w.abs().max()))
    assert_counters_zero()


@pytest.mark.parametrize("dtype", [FP16])
def test_split_k_plain_linear_in_the_model_dtype(monkeypatch, dtype) -> None:
    """The unquantized plain kernel takes split-K too (1 and 8 rows)."""
    for rows in (1, 8):
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, K, generator=gen).to(dtype)
        weight = (0.1 * torch.randn(N, K, generator=gen)).to(dtype)
        bias = torch.randn(N, generator=gen).to(dtype)
        force_tiles(monkeypatch, 3)
        assert_close(
            triton_ops.linear(*on(x, weight, bias)), reference.linear(x, weight, bias), dtype
        )
        assert_counters_zero()


def test_split_k_is_refused_where_the_norm_is_summed_along_the_stream(monkeypatch) -> None:
    """The one-row kernels with the norm fused in the model dtype sum RMSNorm's scale along the
    weight stream, which a K slice does not see whole: a table entry asking for it is an error,
    not a wrong answer."""
    x, residual, norm_weight, _, _, _ = inputs(1, K, N, torch.float32, seed=3)
    weight = torch.randn(N, K)
    force_tiles(monkeypatch, 2)
    with pytest.raises(ValueError, match="no split-K"):
        triton_ops.add_rms_norm_linear(*on(x, residual, norm_weight), 1e-5, weight.to(DEVICE))


def test_split_k_slices_and_the_default_table(monkeypatch) -> None:
    assert split_k.k_per_split(K, 2, 32) == (96, 2)
    assert split_k.k_per_split(K, 3, 32) == (64, 3)
    assert split_k.k_per_split(K, 8, 32) == (32, 5)
    assert split_k.k_per_split(4096, 1, 512) == (4096, 1)
    # The rule splits nothing (an H200's 132 SMs); only the measured entries split.
    monkeypatch.setattr(small_batch_tiles, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    for kernel in small_batch_tiles.KERNELS:
        for n, k in ((4096, 4096), (4096, 14336), (6144, 4096), (28672, 4096)):
            for element_size, rows in ((1, 1), (1, 8), (2, 1)):
                tiles = small_batch_tiles.tile_config(kernel, n, k, cuda, element_size, rows)
                key = (kernel, n, k, element_size, rows == 1)
                if key in small_batch_tiles.MEASURED_TILES:
                    assert tiles == small_batch_tiles.MEASURED_TILES[key]
                else:
                    assert tiles.split_k == 1 and tiles.block_n in (32, 64)
    with pytest.raises(ValueError, match="unknown small-batch kernel"):
        small_batch_tiles.tile_config("gemv", 16, 16, torch.device("cpu"))


def test_outlier_columns_take_the_tiles_measured_for_k_without_them(monkeypatch) -> None:
    monkeypatch.setattr(small_batch_tiles, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    measured = small_batch_tiles.MEASURED_TILES
    for n, k in ((4096, 4096), (4096, 14336)):
        for extra in (16, 128):
            tiles = small_batch_tiles.tile_config("linear", n, k + extra, cuda, 1, 1)
            assert tiles == measured["linear", n, k, 1, True]
        # beyond a few columns, or another element size: the rule's unsplit tiles
        assert small_batch_tiles.tile_config("linear", n, k + 129, cuda, 1, 1).split_k == 1
        assert small_batch_tiles.tile_config("linear", n, k + 16, cuda, 2, 1).split_k == 1


# ---- on the GPU: Llama-3.1-8B's projections, eager and in CUDA graphs -----------------------

HIDDEN, INTERMEDIATE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 4096, 14336, 128, 32, 8


def _llama_weights(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    shapes = {
        "qkv": ((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN),
        "o_proj": (HIDDEN, HIDDEN),
        "gate_up": (2 * INTERMEDIATE, HIDDEN),
        "down": (HIDDEN, INTERMEDIATE),
    }
    out = {}
    for name, (n, k) in shapes.items():
        w = 0.02 * torch.randn(n, k, generator=gen) * torch.logspace(-1, 0.5, n)[:, None]
        w_fp8, w_scale = reference.quantize_fp8(w, None)
        out[name] = (w_fp8, w_scale.view(-1))
    return out


@pytest.fixture(scope="module")
def llama_fp8() -> dict:
    """Float8 weights of one layer, one decode row's inputs, and the reference's outputs."""
    if INTERPRET:
        pytest.skip("needs a CUDA GPU (interpreter run)")
    gen = torch.Generator().manual_seed(5)
    weights = _llama_weights(gen)
    half = torch.arange(HEAD_DIM // 2, dtype=torch.float32)
    freqs = torch.arange(2048, dtype=torch.float32)[:, None] / (500000 ** (2 * half / HEAD_DIM))
    x, residual = (torch.randn(1, HIDDEN, generator=gen).bfloat16() for _ in range(2))
    layer = {
        "x": x,
        "residual": residual,
        "act": torch.randn(1, INTERMEDIATE, generator=gen).bfloat16(),
        "norm_weight": (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16(),
        "cos_sin": torch.cat([freqs.cos(), freqs.sin()], dim=-1),
        "positions": torch.tensor([1000]),
        "slots": torch.tensor([77]),
    }
    caches = [
        empty_cache(8, 16, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cpu"))
        for _ in "kv"
    ]
    want = _decode_layer(reference, weights, layer, caches)
    return {
        "weights": {name: on(*w) for name, w in weights.items()},
        "layer": {name: t.to(DEVICE) for name, t in layer.items()},
        "want": [*want, *caches],
    }


def _decode_layer(ops, weights: dict, layer: dict, caches: list) -> tuple:
    """The four projections of a decode layer as the model calls them (one row: norm fused)."""
    w, a = weights, layer
    query, summed = ops.add_rms_norm_qkv_rotary_write_kv(
        a["x"], a["residual"], a["norm_weight"], 1e-5, w["qkv"][0], None, a["positions"],
        a["cos_sin"], *caches, a["slots"], w["qkv"][1], None,
    )  # fmt: skip
    o = ops.fp8_linear(query.reshape(1, -1), *w["o_proj"], None)
    gated, _ = ops.add_rms_norm_linear_silu_mul(
        o, summed, a["norm_weight"], 1e-5, *w["gate_up"], None
    )
    down = ops.fp8_linear(a["act"], *w["down"], None)
    return query, summed, o, gated, down


@on_gpu
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_split_k_llama8b_decode_layer_bf16(monkeypatch, llama_fp8, split) -> None:
    """Each projection of a batch-1 decode layer, every launch cut `split` ways, against the
    reference on the same float8 weights; the same bits on a second run (the partials are
    summed in split order whatever order the programs finish in)."""
    force_tiles(monkeypatch, split, block_k=None)
    runs = []
    for _ in range(2):
        caches = [torch.zeros_like(c, device=DEVICE) for c in llama_fp8["want"][-2:]]
        got = _decode_layer(triton_ops, llama_fp8["weights"], llama_fp8["layer"], caches)
        runs.append([t.clone() for t in (*got, *caches)])
    for g, w in zip(runs[0], llama_fp8["want"]):
        torch.testing.assert_close(
            g.float().cpu(), w.float(), rtol=0, atol=2e-2 * float(w.float().abs().max())
        )
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "split-K sums must not vary by run"
    assert_counters_zero()


@on_gpu
def test_split_k_in_a_cuda_graph(monkeypatch, llama_fp8) -> None:
    """Split-K launches captured once and replayed on new inputs: the eager results each time,
    the counters back at zero (no memset in the graph resets them)."""
    force_tiles(monkeypatch, 4, block_k=None)
    w = llama_fp8["weights"]
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16, device="cuda")
    act = torch.zeros(1, INTERMEDIATE, dtype=torch.bfloat16, device="cuda")

    def step():
        return triton_ops.fp8_linear(x, *w["o_proj"], None), triton_ops.fp8_linear(
            act, *w["down"], None
        )

    step()  # the warm-up a capture needs (compiles; makes the counters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    gen = torch.Generator().manual_seed(8)
    for _ in range(20):
        x.copy_(torch.randn(1, HIDDEN, generator=gen).bfloat16())
        act.copy_(torch.randn(1, INTERMEDIATE, generator=gen).bfloat16())
        graph.replay()
        for got, want in zip(outs, step()):
            assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert_counters_zero()
