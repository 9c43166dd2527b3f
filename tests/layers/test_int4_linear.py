"""Int4LinearMethod on its own: fused shards load into one packed layer; act-order (g_idx) becomes
one reordering of the inputs; through the reference and the Triton ops (interpreted without a GPU)
the layer computes x @ W^T for W dequantized with each input's own group."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

from kiln.errors import ModelLoadError
from kiln.kernels import reference
from kiln.layers.linear import Linear
from kiln.layers.quantization.int4 import Int4LinearMethod

K, GROUP, SHARDS = 128, 32, (48, 24)


def _shard(rows: int, g_idx: torch.Tensor, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, K), generator=gen)
    scales = torch.rand(rows, K // GROUP, generator=gen) * 0.05 + 0.01
    zeros = torch.randint(0, 16, (rows, K // GROUP), generator=gen).float()
    dense = (codes - zeros[:, g_idx]) * scales[:, g_idx]
    return (reference.pack_int4(codes), scales, zeros, g_idx.to(torch.int32)), dense


def _layer(g_idx: torch.Tensor, other_g_idx: torch.Tensor | None = None):
    layer = Linear(K, sum(SHARDS), output_sizes=list(SHARDS), method=Int4LinearMethod(GROUP))
    dense = []
    for shard, rows in enumerate(SHARDS):
        own = g_idx if shard == 0 or other_g_idx is None else other_g_idx
        tensors, w = _shard(rows, own, seed=shard)
        dense.append(w)
        params = (layer.weight, layer.weight_scales, layer.weight_zeros, layer.weight_g_idx)
        for param, tensor in zip(params, tensors):
            layer.weight_loader(param, shard, tensor)
    layer.method.process_weights_after_loading(layer)
    return layer, torch.cat(dense)


def _ops():
    """Each ops module with the device it runs on (the Triton ops: the GPU when there is one)."""
    pytest.importorskip("triton")
    from kiln.kernels import triton as triton_ops

    gpu = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return [(reference, torch.device("cpu")), (triton_ops, gpu)]


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("rows", [2, 20])
def test_the_layer_computes_its_dequantized_weight(act_order, rows) -> None:
    g_idx = torch.arange(K) // GROUP
    if act_order:
        perm = torch.randperm(K, generator=torch.Generator().manual_seed(5))
        g_idx = torch.empty(K, dtype=torch.int64)
        g_idx[perm] = torch.arange(K) // GROUP
    layer, dense = _layer(g_idx)
    assert (layer.input_order is not None) == act_order
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(9))
    want = x @ dense.t()
    for ops, device in _ops():
        got = layer.to(device)(ops, x.to(device)).cpu()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_shards_with_different_groupings_are_refused() -> None:
    g_idx = torch.arange(K) // GROUP
    with pytest.raises(ModelLoadError, match="g_idx"):
        _layer(g_idx, other_g_idx=g_idx.flip(0))


def test_uneven_groups_are_refused() -> None:
    g_idx = torch.arange(K) // GROUP
    g_idx[0] = 1  # group 1 one input too many, group 0 one too few
    with pytest.raises(ModelLoadError, match="inputs in each group"):
        _layer(g_idx)


def test_scaling_output_rows_scales_the_group_scales() -> None:
    """A float8 KV cache's k / v scales fold into qkv's rows (kiln.models.kv_scales): for INT4,
    through the rows' group scales, so the rows' output scales and the codes stay."""
    layer, dense = _layer(torch.arange(K) // GROUP)
    codes = layer.weight.clone()
    layer.scale_output_rows(slice(48, 72), 0.25)
    x = torch.randn(3, K)
    want = x @ dense.T
    want[:, 48:72] *= 0.25
    torch.testing.assert_close(layer.method.apply(layer, reference, x), want)
    assert torch.equal(layer.weight, codes)


@pytest.fixture
def relay(monkeypatch):
    """The sm_90 path's load on the CPU: every INT4 layer's codes re-laid after loading."""
    from kiln.layers.quantization import int4

    monkeypatch.setattr(int4, "relays_codes", lambda device, k, group_size: True)


@pytest.mark.parametrize("act_order", [False, True])
def test_relaid_codes_are_the_layers_only_copy_and_compute_the_same(relay, act_order) -> None:
    from kiln.kernels.int4_mma_layout import repack

    g_idx = torch.arange(K) // GROUP
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=torch.Generator().manual_seed(5))]
    layer, dense = _layer(g_idx)
    assert layer.weight_mma is not None and layer.weight.numel() == 0
    # The engine's codes: act-order's reordered ones, as a layer without the relay holds them.
    codes = layer.method.engine_tensor(layer, "weight", layer.weight)
    assert codes.shape == (sum(SHARDS), K // 8) and torch.equal(layer.weight_mma, repack(codes))
    assert layer.method.engine_tensor(layer, "weight_scales", layer.weight_scales) is (
        layer.weight_scales
    )
    for rows in (2, 20):  # the small-batch kernel, then the tiled one
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        for ops, device in _ops():
            got = layer.to(device)(ops, x.to(device)).cpu()
            torch.testing.assert_close(got, x @ dense.t(), atol=1e-4, rtol=1e-4)


def test_without_the_relay_the_layer_keeps_kilns_layout() -> None:
    layer, _ = _layer(torch.arange(K) // GROUP)  # on the CPU relays_codes is False
    assert layer.weight_mma is None and layer.weight.shape == (sum(SHARDS), K // 8)
    assert layer.method.engine_tensor(layer, "weight", layer.weight) is layer.weight
