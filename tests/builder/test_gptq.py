"""GPTQ rounding of float8 weights (`kiln build --weight-rounding gptq`): on correlated inputs it
moves a layer's output less than rounding to nearest, with the same scales and format; with
uncorrelated inputs it is rounding to nearest; a build with it loads and answers, under its own
engine id, and the options that cannot use it are one-line errors."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.calibrate.gptq import gptq_fp8
from kiln.errors import BuildError
from kiln.kernels.reference import quantize_fp8


def _correlated_inputs(rows: int, features: int, seed: int) -> torch.Tensor:
    """Rows drawn with `seed` from one fixed distribution whose features move together (most of
    their variance in a few directions, as a layer's activations have), plus a little noise."""
    directions = torch.randn(16, features, generator=torch.Generator().manual_seed(100))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=g) @ directions + 0.05 * torch.randn(
        rows, features, generator=g
    )


def _dequantized(w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return w_fp8.float() * scale


def test_gptq_moves_the_output_less_than_rounding_to_nearest():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g) * 0.05
    x = _correlated_inputs(1024, 96, seed=1)
    hessian = x.T @ x / x.shape[0]
    nearest = _dequantized(*quantize_fp8(w, None))
    w_fp8, scale = gptq_fp8(w, hessian)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == w.shape
    # The same per-row scales as rounding to nearest: the engine format and kernels are unchanged.
    torch.testing.assert_close(scale, quantize_fp8(w, None)[1], rtol=0, atol=0)
    gptq = _dequantized(w_fp8, scale)
    held_out = _correlated_inputs(1024, 96, seed=5)  # other rows of the same distribution
    error_nearest = (held_out @ (w - nearest).T).norm()
    error_gptq = (held_out @ (w - gptq).T).norm()
    assert error_gptq < 0.5 * error_nearest, (error_gptq, error_nearest)


def test_gptq_with_uncorrelated_inputs_is_rounding_to_nearest():
    w = torch.randn(8, 300, generator=torch.Generator().manual_seed(2))  # > one 128-column block
    w_fp8, scale = gptq_fp8(w, torch.eye(300))
    want_fp8, want_scale = quantize_fp8(w, None)
    assert torch.equal(w_fp8.view(torch.uint8), want_fp8.view(torch.uint8))
    assert torch.equal(scale, want_scale)


def test_inputs_never_seen_do_not_stop_the_rounding():
    """A column whose input was always zero (H's row and column zero) still rounds."""
    w = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    x = _correlated_inputs(64, 16, seed=4)
    x[:, 5] = 0
    w_fp8, scale = gptq_fp8(w, x.T @ x)
    assert torch.isfinite(_dequantized(w_fp8, scale)).all()


@pytest.fixture(scope="module")
def chat_source(tmp_path_factory) -> str:
    from tests.tiny_tokenizer import build_tiny_chat_model

    return build_tiny_chat_model(str(tmp_path_factory.mktemp("chat")))


def test_a_gptq_build_loads_answers_and_is_its_own_engine(chat_source, tmp_path):
    from safetensors.torch import load_file

    common = dict(quantization="fp8-dynamic", accuracy_check=False)
    nearest = build_engine(chat_source, str(tmp_path / "n"), BuildOptions(**common), None)
    options = BuildOptions(**common, weight_rounding="gptq")
    gptq = build_engine(chat_source, str(tmp_path / "g"), options, None)
    assert gptq.engine_id != nearest.engine_id
    assert "GPTQ" in gptq.scales_method and "GPTQ" not in nearest.scales_method
    name = next(n for n in gptq.files if n.endswith(".safetensors"))
    a, b = load_file(str(tmp_path / "n" / name)), load_file(str(tmp_path / "g" / name))
    key = "layers.0.mlp.down_proj.weight"
    assert a[key].dtype == torch.float8_e4m3fn and b[key].dtype == torch.float8_e4m3fn
    assert not torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8))
    assert torch.equal(a["layers.0.mlp.down_proj.weight_scale"], b[key + "_scale"])
    out = LLM(str(tmp_path / "g"), kv_cache_memory_gb=0.05, max_num_seqs=2).generate(
        ["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_gptq_without_float8_weights_is_a_one_line_error():
    with pytest.raises(BuildError, match="needs --quantization fp8 or fp8-dynamic"):
        BuildOptions(dtype="float32", quantization="none", weight_rounding="gptq")
    with pytest.raises(BuildError, match="weight_rounding must be one of"):
        BuildOptions(dtype="float32", quantization="fp8-dynamic", weight_rounding="stochastic")
