"""Activation-aware and layer-sequential GPTQ (`kiln build --weight-rounding gptq-aware`,
`gptq-sequential`, `gptq-aware-sequential`): the aware target lowers a layer's output error
against the source's W x when the engine's input is float8 (outlier channels, per token); the
sequential pass runs the model's own layers (the unquantized chain is the forward); its first
projection, whose input no float8 layer precedes, rounds as one-pass GPTQ does; the builds load,
name the rounding in the manifest and the engine id, and refuse what they cannot do."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.errors import BuildError
from kiln.kernels.reference import quantize_fp8
from kiln.quantization.gptq import activation_aware_weight, gptq_fp8


def _outlier_inputs(rows: int, features: int, seed: int) -> torch.Tensor:
    """Correlated rows with three channels ~300x the rest (the outliers' rounding error, the
    largest, is what the aware target can reduce)."""
    directions = torch.randn(8, features, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 8, generator=g) @ directions * 0.01 + 0.01 * torch.randn(
        rows, features, generator=g
    )
    x[:, [3, 17, 40]] = 3.0 + 0.3 * torch.randn(rows, 3, generator=g)
    return x


def _engine_input(x: torch.Tensor) -> torch.Tensor:
    codes, scale = quantize_fp8(x, None)  # per token, as fp8-dynamic's engine quantizes it
    return codes.float() * scale


def test_the_aware_target_lowers_the_output_error_against_the_source():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g) * 0.05
    x = _outlier_inputs(2048, 64, seed=1)
    xq = _engine_input(x)
    n = x.shape[0]
    plain = gptq_fp8(w, x.T @ x / n)
    hq = xq.T @ xq / n
    aware = gptq_fp8(activation_aware_weight(w, x.T @ xq / n, hq).float(), hq)
    held_out = _outlier_inputs(2048, 64, seed=2)  # other rows of the same distribution
    want = held_out @ w.T

    def error(rounded: tuple[torch.Tensor, torch.Tensor]) -> float:
        q = rounded[0].float() * rounded[1]
        return float((want - _engine_input(held_out) @ q.T).norm())

    # Per-token rounding noise is mostly independent of x: a linear correction takes a few
    # percent of it (6% here; the same at 10x and 100x larger outliers, and with static scales).
    assert error(aware) < 0.97 * error(plain), (error(aware), error(plain))
    # Without float8 inputs (xq = x) the target is W itself: the aware rounding is GPTQ's.
    same = activation_aware_weight(w, x.T @ x / n, x.T @ x / n)
    torch.testing.assert_close(same.float(), w, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def chat_source(tmp_path_factory) -> str:
    from tests.tiny_tokenizer import build_tiny_chat_model

    return build_tiny_chat_model(str(tmp_path_factory.mktemp("chat")))


@pytest.fixture(scope="module")
def source_llm(chat_source):
    llm = LLM(chat_source, dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=2,
              enable_prefix_caching=False)  # fmt: skip
    yield llm
    llm.shutdown()


WINDOWS = [[1, 5, 9, 33, 7, 60, 61, 62, 80, 3, 4, 5], [1, 200, 3, 17, 44, 45, 46]]


def test_the_layer_chain_is_the_models_forward(source_llm):
    from kiln.quantization import sequential

    runner = source_llm.engine.executor.runner
    model = runner.model
    step = sequential._packed_prefill(model, WINDOWS, model.norm.device)
    with torch.no_grad():
        hidden, residual = model.embed_tokens(step.input_ids), None
        for layer in model.layers:
            hidden, residual = sequential._layer_forward(
                model, layer, runner.ops, runner.backend, hidden, residual, step
            )
        chained, _ = runner.ops.fused_add_rms_norm(hidden, residual, model.norm, 1e-5)
        caches = [(torch.zeros_like(step.k_cache), torch.zeros_like(step.v_cache))
                  for _ in model.layers]  # fmt: skip
        want = model(runner.ops, runner.backend, step.input_ids, step.positions, caches,
                     step.metadata)  # fmt: skip
    torch.testing.assert_close(chained, want, rtol=1e-5, atol=1e-5)


def test_sequential_rounding_starts_as_one_pass_gptq_then_differs(source_llm):
    from kiln.quantization import sequential
    from kiln.quantization.gptq import calibrate_hessians

    runner = source_llm.engine.executor.runner
    model = runner.model
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    hessians = calibrate_hessians(model, WINDOWS, lambda b: source_llm.generate(b, one_token))
    spec = sequential.RoundingSpec(aware=False, quantized_input=False)
    with torch.no_grad():
        rounded = sequential.round_sequentially(
            model, runner.ops, runner.backend, WINDOWS, spec, None
        )
    assert len(rounded) == 4 * len(model.layers)

    def one_pass(name: str) -> torch.Tensor:
        weight = dict(model.named_modules())[name].weight.detach().float()
        return gptq_fp8(weight, hessians[name])[0].view(torch.uint8)

    first = "layers.0.self_attn.qkv_proj"  # its input: the embedding's norm, no float8 before
    assert torch.equal(rounded[first][0].view(torch.uint8), one_pass(first))
    last = "layers.1.mlp.down_proj"  # its input went through five float8 projections
    assert not torch.equal(rounded[last][0].view(torch.uint8), one_pass(last))


@pytest.mark.parametrize("rounding", ["gptq-aware", "gptq-aware-sequential"])
def test_a_build_with_it_loads_answers_and_names_it(chat_source, tmp_path, rounding):
    from safetensors.torch import load_file

    common = dict(quantization="fp8", accuracy_check=False)  # static scales: the harder case
    gptq = build_engine(chat_source, str(tmp_path / "g"), BuildOptions(**common,
                        weight_rounding="gptq"), None)  # fmt: skip
    options = BuildOptions(**common, weight_rounding=rounding)
    built = build_engine(chat_source, str(tmp_path / "a"), options, None)
    assert built.engine_id != gptq.engine_id
    assert "activation-aware" in built.scales_method
    assert ("layer after layer" in built.scales_method) == rounding.endswith("-sequential")
    name = next(n for n in built.files if n.endswith(".safetensors"))
    a, b = load_file(str(tmp_path / "g" / name)), load_file(str(tmp_path / "a" / name))
    key = "layers.1.mlp.down_proj.weight"
    assert b[key].dtype == torch.float8_e4m3fn
    assert not torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8))
    llm = LLM(str(tmp_path / "a"), kv_cache_memory_gb=0.05, max_num_seqs=2)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.shutdown()


def test_what_it_cannot_do_is_a_one_line_error():
    with pytest.raises(BuildError, match="needs --quantization fp8 or fp8-dynamic"):
        BuildOptions(quantization="none", weight_rounding="gptq-aware")


def test_a_tp2_sequential_build_is_the_tp1_engines_cut(chat_source, tmp_path):
    """gptq-sequential rounds the whole model in the build's process; -tp 2 writes each rank
    the cut of those weights: every rank's parameters equal, byte for byte, what that rank cuts
    from the -tp 1 engine when it loads it whole."""
    from kiln.config import EngineConfig
    from kiln.distributed.parallel_state import ParallelContext, RankLayout
    from kiln.runtime.model_loader import load_model

    common = dict(quantization="fp8", weight_rounding="gptq-sequential", accuracy_check=False)
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    build_engine(chat_source, one, BuildOptions(**common), None)
    built = build_engine(chat_source, two, BuildOptions(**common, tensor_parallel_size=2), None)
    assert built.tensor_parallel_size == 2 and "layer after layer" in built.scales_method
    cpu, fp32 = torch.device("cpu"), torch.float32
    for rank in range(2):
        ctx = ParallelContext(RankLayout(2, 1, rank), None, None, None)
        config = EngineConfig(model=two, dtype="float32", tensor_parallel_size=2)
        got = load_model(config, cpu, fp32, ctx).model
        want = dict(load_model(EngineConfig(model=one, dtype="float32"), cpu, fp32, ctx).model
                    .named_parameters())  # fmt: skip
        for name, param in got.named_parameters():
            a, b = param.detach(), want[name].detach()
            if a.dtype == torch.float8_e4m3fn:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a, b), (rank, name)


def test_gptq_sequential_rounds_from_its_own_windows_and_damp(monkeypatch):
    """The build's gptq-sequential: 32 calibration windows and damp 0.1 (the defaults measured
    best on SmolLM2), the aware variant as before (8 windows, damp 0.01)."""
    from kiln.builder import quantize
    from kiln.quantization import sequential

    seen = {}

    def fake_round(model, ops, backend, batches, spec, input_scales, kept, on_layer=None):
        seen["windows"], seen["spec"] = len(batches), spec
        return {}

    monkeypatch.setattr(sequential, "round_sequentially", fake_round)

    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return list(range(len(text)))

    class Fake:  # an LLM's surface as round_weights uses it
        engine = type("E", (), {"max_model_len": 513, "executor": None})()

        def get_tokenizer(self):
            return Tokenizer()

    llm = Fake()
    model = type("M", (), {"layers": [None, None]})()  # its layers count the progress bar's steps
    llm.engine.executor = type("X", (), {"runner": type("R", (), {"model": model, "ops": None,
                                         "backend": None})()})()  # fmt: skip
    text = "x" * (512 * 40)
    quantize.round_weights(llm, text, "gptq-sequential", None, [])
    assert seen["windows"] == 32 and seen["spec"].damp == 0.1 and not seen["spec"].aware
    quantize.round_weights(llm, text, "gptq-aware-sequential", None, [])
    assert seen["windows"] == 8 and seen["spec"].damp == 0.01 and seen["spec"].aware


def test_the_sequential_roundings_parameters_name_the_engine(chat_source, tmp_path, monkeypatch):
    """Changed defaults build a different engine: its id changes, so no cache hands back one
    rounded the old way."""
    from kiln.builder import build

    options = BuildOptions(quantization="fp8-dynamic", weight_rounding="gptq-sequential",
                           accuracy_check=False)  # fmt: skip
    first = build_engine(chat_source, str(tmp_path / "a"), options, None)
    monkeypatch.setattr(build, "SEQUENTIAL_DAMP", 0.5)
    second = build_engine(chat_source, str(tmp_path / "b"), options, None)
    assert first.engine_id != second.engine_id
