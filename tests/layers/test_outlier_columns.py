"""Outlier columns (kiln.layers.quantization.outlier_columns, `kiln build --outlier-columns`):
the chosen channels' remainder is a second float8 term, the projection computes exactly that
two-term arithmetic, and a static fp8 engine of a model with loud channels comes closer to its
source with them; named in the manifest and the engine id, refused where it cannot apply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.builder.build import BuildOptions, build_engine
from kiln.cli.main import main
from kiln.errors import BuildError
from kiln.kernels import reference
from kiln.layers.linear import Linear
from kiln.layers.quantization.fp8 import Fp8LinearMethod
from kiln.layers.quantization.outlier_columns import OutlierColumnsFp8LinearMethod, choose_channels
from kiln.models.blocks import gated_mlp
from tests.conftest import teacher_forced_logprobs

LOUD = [3, 40]  # the input channels made loud in the test model (hidden size 64)


def _loud_input(rows: int = 32, k: int = 64, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, LOUD] *= 60.0
    return x


def test_the_remainder_carries_the_chosen_channels_to_about_seven_bits():
    x = _loud_input()
    scale = torch.tensor(float(x.abs().max()) / reference.FP8_E4M3_MAX)
    x_fp8, _ = reference.quantize_fp8(x, scale)
    rest = reference.fp8_remainder(x, x_fp8, scale, torch.tensor(LOUD))
    exact = x[:, LOUD] / scale
    one_term = x_fp8[:, LOUD].float()
    two_terms = one_term + rest.float()
    # e4m3 keeps 3 bits (relative error up to 1/16); its remainder 3 more of what is left.
    assert ((one_term - exact).abs() / exact.abs()).max() > 1 / 100
    assert ((two_terms - exact).abs() / exact.abs()).max() < 1 / 200


def test_past_a_static_scale_the_remainder_carries_the_excess():
    """Unseen text past the calibration's absmax: e4m3 saturates at 448, the remainder carries
    the excess (itself saturating), so a chosen channel holds up to 2 x 448 x scale."""
    x = torch.tensor([[592.0, 1.0, -704.0, 2000.0]])
    x_fp8, scale = reference.quantize_fp8(x, torch.tensor(1.0))
    rest = reference.fp8_remainder(x, x_fp8, scale, torch.tensor([0, 2, 3]))
    assert x_fp8.float()[0, [0, 2, 3]].tolist() == [448.0, -448.0, 448.0]
    assert rest.float()[0].tolist() == [144.0, -256.0, 448.0]


def _linear(method: Fp8LinearMethod, weight: torch.Tensor) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], method=method, dtype=torch.float32)
    layer.weight_loader(layer.weight, None, weight)
    return layer


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_a_projection_computes_the_two_term_product_and_errs_less(scheme):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=gen) * 0.1
    x = _loud_input()
    scale = float(x.abs().max()) / reference.FP8_E4M3_MAX if scheme == "static" else None
    channels = LOUD + [c for c in range(64) if c not in LOUD][:14]  # 16, in no order
    plain = _linear(Fp8LinearMethod(scheme, scale), weight)
    outlier = _linear(OutlierColumnsFp8LinearMethod(scheme, scale, channels=channels), weight)

    codes, w_scale = reference.quantize_fp8(weight, None)
    assert torch.equal(outlier.weight[:, :64].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(
        outlier.weight[:, 64:].view(torch.uint8), codes[:, channels].view(torch.uint8)
    )
    y = outlier(reference, x)
    # The arithmetic in plain fp32, written out.
    s = torch.tensor(scale) if scale else x.abs().amax(-1, keepdim=True) / reference.FP8_E4M3_MAX
    q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    r = (x[:, channels] / s - q[:, channels]).to(torch.float8_e4m3fn).float()
    want = (torch.cat([q, r], 1) @ codes.float()[:, list(range(64)) + channels].t()) * s
    want = want * w_scale.view(1, -1)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)

    exact = x @ (codes.float() * w_scale.view(-1, 1)).t()  # the inputs' error alone
    err_plain = (plain(reference, x) - exact).norm()
    err_outlier = (y - exact).norm()
    if scheme == "static":  # the loud channels' 3-bit rounding is most of static's error
        assert err_outlier < 0.6 * err_plain
    else:  # per token the largest value is exact already: the others gain a little
        assert err_outlier <= err_plain


def test_choosing_takes_the_loudest_channels_and_refuses_too_many():
    amax = torch.arange(32.0)
    amax[[5, 9]] = 100.0
    assert choose_channels({"a": amax}, 16) == {"a": [5, 9, *range(18, 32)]}
    with pytest.raises(ValueError, match="has 32 input channels"):
        choose_channels({"a": amax}, 48)


@pytest.fixture(scope="module")
def loud_source(tmp_path_factory) -> str:
    """The tiny chat Llama (it has a tokenizer, which calibration needs) with two channels of
    each norm's output and two of each SiLU-mul's made 60x louder (not compensated: a model
    whose loud channels carry much of each projection's output, as massive activations do)."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("loud")))
    file = Path(path) / "model.safetensors"
    t = load_file(str(file))
    for i in range(2):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[p + norm + ".weight"][LOUD] *= 60.0
        t[p + "mlp.up_proj.weight"][[7, 90]] *= 60.0
    save_file(t, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def static_builds(loud_source, tmp_path_factory):
    out = tmp_path_factory.mktemp("builds")
    # float32 as the tests load them (a build on a GPU machine defaults to bfloat16).
    common = dict(quantization="fp8", max_model_len=128, accuracy_check=False, dtype="float32")
    plain = build_engine(loud_source, str(out / "plain"), BuildOptions(**common), None)
    argv = ["build", loud_source, "-o", str(out / "outlier"), "--quantization", "fp8",
            "--max-model-len", "128", "--no-accuracy-check", "--outlier-columns", "16",
            "--dtype", "float32"]  # fmt: skip
    assert main(argv) == 0
    return plain, out


def test_a_static_engine_with_outlier_columns_is_closer_to_its_source(static_builds, loud_source):
    """Per-token logprob error against the unquantized source on held-out text."""
    from kiln.builder.accuracy import HELD_OUT_FILE

    _, out = static_builds
    with open(HELD_OUT_FILE, encoding="utf-8") as f:
        text = f.read(2000)
    want = teacher_forced_logprobs(loud_source, text)
    err_plain = (teacher_forced_logprobs(str(out / "plain"), text) - want).abs().mean()
    err_outlier = (teacher_forced_logprobs(str(out / "outlier"), text) - want).abs().mean()
    # Measured 0.241 -> 0.171: the rest is the loud channels' weight columns' rounding, which
    # outlier columns leave as it is.
    assert err_outlier < 0.8 * err_plain, (err_outlier, err_plain)


def test_the_manifest_names_the_channels_and_the_weights_hold_their_columns(static_builds):
    from safetensors import safe_open

    plain, out = static_builds
    manifest = json.loads((out / "outlier" / "kiln_engine.json").read_text())
    assert manifest["engine_id"] != plain.engine_id and plain.outlier_channels is None
    channels = manifest["outlier_channels"]
    assert len(channels) == 8 and all(len(c) == 16 for c in channels.values())
    assert set(LOUD) <= set(channels["layers.0.self_attn.qkv_proj"])
    assert {7, 90} <= set(channels["layers.1.mlp.down_proj"])
    assert "16 loudest input channels" in manifest["scales_method"]
    with safe_open(str(out / "outlier" / "weights-00001-of-00001.safetensors"), "pt") as f:
        weight = f.get_tensor("layers.1.mlp.down_proj.weight")
    assert weight.shape == (64, 128 + 16)
    assert torch.equal(weight[:, 128:].view(torch.uint8),
                       weight[:, channels["layers.1.mlp.down_proj"]].view(torch.uint8))  # fmt: skip


def test_outlier_columns_where_they_cannot_apply_are_a_clear_error():
    with pytest.raises(BuildError, match="a multiple of 16"):
        BuildOptions(dtype="float32", quantization="fp8", outlier_columns=8)
    with pytest.raises(BuildError, match="need --quantization fp8 or fp8-dynamic"):
        BuildOptions(dtype="float32", quantization="none", outlier_columns=16)


def _rank_layers(engine: str, name: str, tp: int = 2) -> list[Linear]:
    """Layer `name` of the one-process model (first) and of each tensor rank's (as a worker
    process would load it), from one engine directory."""
    from kiln.config import EngineConfig
    from kiln.distributed.parallel_state import ParallelContext, RankLayout
    from kiln.runtime.model_loader import load_model

    config = EngineConfig(model=engine, dtype="float32", tensor_parallel_size=tp)
    contexts = [None] + [ParallelContext(RankLayout(tp, 1, r), None, None, None) for r in range(tp)]
    return [
        load_model(config if ctx else EngineConfig(model=engine, dtype="float32"),
                   torch.device("cpu"), torch.float32, ctx).model.get_submodule(name)
        for ctx in contexts
    ]  # fmt: skip


def test_row_parallel_ranks_keep_their_channels_and_sum_to_one_process(static_builds):
    """down_proj at -tp 2: each rank keeps the chosen channels inside its 64 input columns
    (renumbered), padded to 16 with channels of its own whose appended columns are zero; the
    ranks' partial products add up to the one-process projection (the static scale is one
    tensor, so each rank quantizes its slice exactly as the whole)."""
    from kiln.kernels import reference as ops

    _, out = static_builds
    whole, *ranks = _rank_layers(str(out / "outlier"), "layers.1.mlp.down_proj")
    chosen = whole.method.channels
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    x[:, [7, 90]] *= 40.0
    partial = torch.zeros(5, 64)
    for rank, layer in enumerate(ranks):
        start = 64 * rank
        mine = [c - start for c in chosen if start <= c < start + 64]
        index = layer.outlier_index.tolist()
        assert set(mine) <= set(index) and len(index) == 16 and index == sorted(index)
        extra = layer.weight[:, 64:].view(torch.uint8)
        for j, channel in enumerate(index):
            column = extra[:, j]
            if channel in mine:  # the one-process weight's appended column for that channel
                want = whole.weight[:, 128 + chosen.index(channel + start)].view(torch.uint8)
                assert torch.equal(column, want)
            else:
                assert not column.any()
        partial += layer.method.apply(layer, ops, x[:, start : start + 64])
    torch.testing.assert_close(partial, whole.method.apply(whole, ops, x), rtol=1e-5, atol=1e-5)


def test_a_row_parallel_rank_from_model_dtype_weights_is_the_engine_weights_cut():
    """A row-parallel rank loading a model-dtype weight (the whole rows quantized, laid out as an
    engine holds them, then cut) holds what it would cut from the -tp 1 layer's weight; 8 of
    16 channels in each half, so each rank pads 8 zero columns."""
    from kiln.distributed.parallel_state import ParallelContext, RankLayout
    from kiln.layers.linear import TensorSplit

    channels = list(range(0, 128, 8))
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    whole = Linear(128, 64, method=OutlierColumnsFp8LinearMethod("dynamic", channels=channels))
    whole.weight_loader(whole.weight, None, weight)
    for rank in range(2):
        ctx = ParallelContext(RankLayout(2, 1, rank), None, None, None)
        method = OutlierColumnsFp8LinearMethod("dynamic", channels=channels)
        part = Linear(64, 64, method=method, split=TensorSplit(ctx, cols=(64 * rank, 64)))
        part.weight_loader(part.weight, None, weight)
        assert part.outlier_index.numel() == 16 and method.slots.count(None) == 8
        want = method.input_columns(part, whole.weight.detach())
        assert torch.equal(part.weight.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(part.weight_scale, whole.weight_scale)


def test_outlier_engines_at_tp2_equal_one_process(static_builds, loud_source, tmp_path):
    """The -tp 1 engine loaded at -tp 2 (each rank cuts it), and a -tp 2 build (each rank its
    shard, the same cut): greedy tokens as one process, logprobs within fp32 summation order."""
    from kiln import LLM, SamplingParams

    _, out = static_builds
    split = str(tmp_path / "tp2")
    options = BuildOptions(quantization="fp8", max_model_len=128, accuracy_check=False,
                           outlier_columns=16, tensor_parallel_size=2, dtype="float32")  # fmt: skip
    build_engine(loud_source, split, options, None)
    prompts = [[1, 5, 9, 13, 40, 22, 8], [1, 30, 31, 32]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    common = dict(dtype="float32", num_threads=1, distributed_timeout_s=60, device="cpu")
    want = LLM(str(out / "outlier"), **common).generate(prompts, params)
    for engine in (str(out / "outlier"), split):
        llm = LLM(engine, tensor_parallel_size=2, **common)
        try:
            got = llm.generate(prompts, params)
        finally:
            llm.shutdown()
        for a, b in zip(got, want):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, engine
            for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa), engine


def _triton_ops():
    pytest.importorskip("triton")
    from kiln.kernels import triton as triton_ops

    return triton_ops


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter gets bf16 wrong (FACTS.md): bf16 on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _same_codes(got: torch.Tensor, want: torch.Tensor, channels: torch.Tensor, exact: bool):
    """Equal float8 codes. Where not `exact` (a norm's fp32 sum of squares and rsqrt, the
    interpreter's exp in SiLU: the quantized values may differ from the reference's in a last
    bit) up to 2% of the row codes one e4m3 step apart, and each chosen channel's two terms
    (its code plus its remainder) within 2^-6 of the reference's."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.cpu(), want.cpu()
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    if exact:
        assert not bool(differ.any()), f"{int(differ.sum())} of {differ.numel()} codes differ"
        return
    k = got.shape[1] - channels.numel()
    g, w = got[:, :k].float(), want[:, :k].float()
    assert bool(((g - w).abs() <= torch.maximum(g.abs(), w.abs()) / 8 + 2**-9).all())
    assert float(differ[:, :k].float().mean()) <= 0.02
    two_got = g[:, channels] + got[:, k:].float()
    two_want = w[:, channels] + want[:, k:].float()
    torch.testing.assert_close(two_got, two_want, rtol=2**-6, atol=2**-9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("count", [16, 48])  # 48: lanes past the count, masked
@pytest.mark.parametrize("op", ["quantize", "norm", "norm+residual", "silu-row", "silu-grid",
                                "silu-two-pass"])  # fmt: skip
def test_the_quantizing_kernels_write_the_reference_remainders(
    monkeypatch, op, count, static, dtype
):
    """Each op before an outlier-columns projection (the quantize kernel, the norm, the SiLU-mul
    in its three launch shapes) writes the chosen channels' remainders after its own columns in
    the same pass: every float8 code and scale the reference's, saturated channels included."""
    triton_ops = _triton_ops()
    from kiln.kernels.triton import silu_mul

    if op == "silu-grid":  # several column programs a row (the static small-row path)
        monkeypatch.setattr(silu_mul, "_static_quant_tiles", lambda d, rows: (16, 1))
    elif op == "silu-two-pass":  # the row in 16-wide blocks, read twice
        monkeypatch.setattr(silu_mul, "_QUANT_ONE_PASS_MAX", 16)
        monkeypatch.setattr(silu_mul, "_QUANT_LOOP_BLOCK", 16)
    if op in ("silu-row", "silu-two-pass"):
        monkeypatch.setattr(silu_mul, "_STATIC_GRID_MAX_ROWS", 0)
    gen = torch.Generator().manual_seed(7)
    k = 64
    loud = [3, 17, 40]
    x = torch.randn(5, 2 * k if op.startswith("silu") else k, generator=gen) * 3
    x[:, loud] *= 8.0  # past the static scale's 448 in some rows
    x[4] = 0.0  # a zero row: the dynamic scale's floor
    x = x.to(dtype)
    channels = torch.randperm(k, generator=gen)[:count]
    channels[:3] = torch.tensor(loud)
    scale = torch.tensor(0.05) if static else None
    if op.startswith("norm"):
        residual = None
        if op == "norm+residual":
            residual = torch.randn(5, k, generator=gen) * 3
            residual[4] = 0.0
            residual = residual.to(dtype)
        weight = (1 + torch.rand(k, generator=gen)).to(dtype)
        weight[loud] *= 30.0
        args = (x, residual, weight, 1e-5, scale)
        name = "add_rms_norm_quant_fp8"
    else:
        args = (x, scale)
        name = "quantize_fp8" if op == "quantize" else "silu_and_mul_quant_fp8"
    want = getattr(reference, name)(*args, channels)
    on = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in (*args, channels)]
    got = getattr(triton_ops, name)(*on)
    _same_codes(got[0], want[0], channels, exact=op == "quantize")
    torch.testing.assert_close(got[1].cpu(), want[1], rtol=1e-6, atol=0)
    assert want[0].shape[1] == k + count
    rest = want[0][:, k:].float()
    assert bool(rest[:4].ne(0).any()) and not bool(rest[4].ne(0).any())


def _outlier_block(scheme: str, dtype: torch.dtype, k: int = 64, inter: int = 96) -> dict:
    """The MLP of a decoder with outlier columns on gate_up and down: Linear layers on DEVICE."""
    gen = torch.Generator().manual_seed(2)
    layers = {}
    for name, (n_in, n_out, sizes) in {
        "gate_up": (k, 2 * inter, [inter, inter]), "down": (inter, k, None)
    }.items():  # fmt: skip
        weight = torch.randn(n_out, n_in, generator=gen) * 0.1
        scale = 0.05 if scheme == "static" else None
        channels = sorted(torch.randperm(n_in, generator=gen)[:16].tolist())
        method = OutlierColumnsFp8LinearMethod(scheme, scale, channels=channels)
        with torch.device(DEVICE):
            layers[name] = Linear(n_in, n_out, method=method, dtype=dtype, output_sizes=sizes)
        layers[name].weight_loader(layers[name].weight, None, weight.to(DEVICE))
        method.process_weights_after_loading(layers[name])  # on CUDA: rows 128 bytes apart
    return layers


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
@pytest.mark.parametrize("rows", [1, 24])  # the small-batch kernel's GEMV; the GEMM path
def test_the_triton_ops_compute_what_the_reference_does(monkeypatch, scheme, rows):
    """The decoder's entry points with outlier columns through the Triton ops (the norm and the
    SiLU-mul writing the remainders; the projection in the small-batch kernel at one row, by
    torch._scaled_mm on the GPU above it, by the reference's sums under the CPU's interpreter)
    against the reference ops; in a CUDA graph too where there is a GPU."""
    triton_ops = _triton_ops()
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    layers = _outlier_block(scheme, dtype)
    gate_up, down = layers["gate_up"], layers["down"]
    gen = torch.Generator().manual_seed(3)
    x = (_loud_input(rows=rows) / 20).to(DEVICE, dtype)
    residual = torch.randn(rows, 64, generator=gen).to(DEVICE, dtype)
    norm = torch.ones(64, dtype=dtype, device=DEVICE)
    activation = torch.randn(rows, 96, generator=gen).to(DEVICE, dtype)

    def block(ops):
        mlp, summed = gated_mlp(ops, gate_up, down, x, residual, norm, 1e-5)
        return mlp, summed, down(ops, activation)  # down alone: apply()'s quantize kernel

    if DEVICE == "cuda":
        assert gate_up.weight.stride(0) % 128 == 0 and down.weight.stride(0) % 128 == 0
    from kiln.kernels.triton import small_batch_linear

    launches = []
    launch = small_batch_linear._launch
    monkeypatch.setattr(
        small_batch_linear, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k)
    )
    want = block(reference)
    got = block(triton_ops)
    # One row: gate_up, down and down alone each in the small-batch kernel.
    assert len(launches) == (3 if rows == 1 else 0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    if DEVICE == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(triton_ops)
        graph.replay()
        for c, g in zip(captured, got, strict=True):
            torch.testing.assert_close(c, g)
