"""Static fp8 input scales by search (`kiln build --activation-scales mse`,
kiln.quantization.calibration): the searched scale lowers the output error where one outlier
sets absmax for small inputs, stays absmax where nothing gains, and is named in the manifest
and the engine id; refused where there are no static scales."""

from __future__ import annotations

import pytest
import torch

from kiln.builder.build import BuildOptions, build_engine
from kiln.errors import BuildError
from kiln.kernels import reference as ops
from kiln.kernels.reference import FP8_E4M3_MAX, quantize_fp8
from kiln.layers.linear import Linear
from kiln.quantization.calibration import ACTIVATION_SCALE_GRID, _ScaleSearch


def _layer(gen: torch.Generator) -> Linear:
    layer = Linear(64, 32, dtype=torch.float32)
    layer.weight.data.copy_(torch.randn(32, 64, generator=gen))
    return layer


def _searched(layer: Linear, x: torch.Tensor) -> tuple[float, float]:
    """(the searched scale, amax's scale) for the inputs x."""
    amax = float(x.abs().max()) / FP8_E4M3_MAX
    search = _ScaleSearch(layer.method, torch.tensor(ACTIVATION_SCALE_GRID) * amax)
    y = search.apply(layer, ops, x)
    torch.testing.assert_close(y, x @ layer.weight.T)  # the wrapped arithmetic, unchanged
    return float(search.candidates[int(torch.argmin(search.error))]), amax


def _relative_error(layer: Linear, x: torch.Tensor, scale: float) -> float:
    """Mean over tokens of |output error| / |output|, the real matmul's (not the estimate's)."""
    q, s = quantize_fp8(x, torch.tensor(scale))
    y = x @ layer.weight.T
    return float(((q.float() * s @ layer.weight.T - y).norm(dim=1) / y.norm(dim=1)).mean())


def test_an_outlier_token_gets_a_smaller_scale_and_less_output_error():
    gen = torch.Generator().manual_seed(0)
    layer = _layer(gen)
    # 255 tokens of small inputs, one token 3e4x larger (an attention sink's activations): at
    # absmax / 448 the small ones fall to e4m3's subnormals, where its relative error grows.
    x = torch.randn(256, 64, generator=gen) * 1e-3
    x[0] *= 3e4
    scale, amax = _searched(layer, x)
    assert scale < amax
    # Each token's output error relative to its own output: the quiet tokens gain.
    assert _relative_error(layer, x, scale) < 0.8 * _relative_error(layer, x, amax)


def test_without_outliers_the_search_keeps_absmax():
    gen = torch.Generator().manual_seed(1)
    layer = _layer(gen)
    x = torch.randn(256, 64, generator=gen)  # e4m3's relative error is the same at any scale
    scale, amax = _searched(layer, x)  # in range, so clipping the top only costs
    assert scale == pytest.approx(amax)


@pytest.fixture(scope="module")
def static_builds(tmp_path_factory):
    from tests.tiny_tokenizer import build_tiny_chat_model

    source = build_tiny_chat_model(str(tmp_path_factory.mktemp("src")))
    out = tmp_path_factory.mktemp("builds")
    common = dict(quantization="fp8", max_model_len=128, accuracy_check=False)
    amax = build_engine(source, str(out / "amax"), BuildOptions(**common), None)
    options = BuildOptions(**common, activation_scales="mse")
    mse = build_engine(source, str(out / "mse"), options, None)
    return amax, mse, out


def test_the_manifest_and_the_engine_id_carry_the_search(static_builds):
    amax, mse, _ = static_builds
    assert mse.engine_id != amax.engine_id
    assert "least output error" in mse.scales_method
    assert "least output error" not in amax.scales_method


def test_the_searched_scales_are_grid_multiples_of_absmax(static_builds):
    from safetensors.torch import load_file

    _, _, out = static_builds
    scales = {}
    for name in ("amax", "mse"):
        tensors = {}
        for f in (out / name).glob("*.safetensors"):
            tensors.update(load_file(str(f)))
        scales[name] = {k: float(v) for k, v in tensors.items() if k.endswith("input_scale")}
    assert scales["amax"] and set(scales["mse"]) == set(scales["amax"])
    for key, s in scales["mse"].items():
        ratio = s / scales["amax"][key]
        assert min(abs(ratio - a) for a in ACTIVATION_SCALE_GRID) < 1e-4, (key, ratio)


def test_the_search_needs_static_scales():
    with pytest.raises(BuildError, match="needs --quantization fp8"):
        BuildOptions(quantization="fp8-dynamic", activation_scales="mse")
    with pytest.raises(BuildError, match="activation_scales must be one of"):
        BuildOptions(quantization="fp8", activation_scales="percentile")
