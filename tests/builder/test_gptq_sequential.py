"""Layer-sequential GPTQ (`kiln build --weight-rounding gptq-sequential`,
kiln.builder.calibrate.sequential): the pass runs the model's own decoder layers (chained, they
are the forward); its first projection, whose input no float8 layer precedes, rounds as one-pass
GPTQ does; the build loads, names the rounding in the manifest and the engine id, cuts per
tensor rank, and refuses what it cannot do."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.calibrate.gptq import gptq_fp8
from kiln.errors import BuildError


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
    from kiln.builder.calibrate import sequential
    from kiln.models.blocks import StepInputs

    runner = source_llm.engine.executor.runner
    model = runner.model
    step = sequential._packed_prefill(model, WINDOWS)
    inputs = StepInputs(runner.ops, runner.backend, step.positions, model.cos_sin_cache,
                        step.metadata)  # fmt: skip
    with torch.no_grad():
        hidden, residual = model.embed_tokens(step.input_ids), None
        for layer in model.layers:
            hidden, residual = layer(inputs, hidden, residual, (step.k_cache, step.v_cache))
        chained, _ = runner.ops.fused_add_rms_norm(hidden, residual, model.norm, 1e-5)
        caches = [(torch.zeros_like(step.k_cache), torch.zeros_like(step.v_cache))
                  for _ in model.layers]  # fmt: skip
        want = model(runner.ops, runner.backend, step.input_ids, step.positions, caches,
                     step.metadata)  # fmt: skip
    torch.testing.assert_close(chained, want, rtol=1e-5, atol=1e-5)


def test_sequential_rounding_starts_as_one_pass_gptq_then_differs(source_llm):
    from kiln.builder.calibrate import sequential
    from kiln.builder.calibrate.gptq import calibrate_hessians

    runner = source_llm.engine.executor.runner
    model = runner.model
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    hessians = calibrate_hessians(model, WINDOWS, lambda b: source_llm.generate(b, one_token))
    spec = sequential.RoundingSpec(quantized_input=False)
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


def test_what_it_cannot_do_is_a_one_line_error():
    with pytest.raises(BuildError, match="needs --quantization fp8 or fp8-dynamic"):
        BuildOptions(dtype="float32", quantization="none", weight_rounding="gptq-sequential")
    with pytest.raises(BuildError, match="weight_rounding must be one of"):
        BuildOptions(
            dtype="float32", quantization="fp8", weight_rounding="gptq-aware"
        )  # measured worse: gone


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
    best on SmolLM2)."""
    from kiln.builder import quantize
    from kiln.builder.calibrate import sequential

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
    quantize.round_weights(llm, text, None, [])
    assert seen["windows"] == 32 and seen["spec"].damp == 0.1


def test_the_sequential_roundings_parameters_name_the_engine(chat_source, tmp_path, monkeypatch):
    """Changed defaults build a different engine: its id changes, so no cache hands back one
    rounded the old way."""
    from kiln.builder import build

    options = BuildOptions(dtype="float32", quantization="fp8-dynamic",
                           weight_rounding="gptq-sequential", accuracy_check=False)  # fmt: skip
    first = build_engine(chat_source, str(tmp_path / "a"), options, None)
    monkeypatch.setattr(build, "SEQUENTIAL_DAMP", 0.5)
    second = build_engine(chat_source, str(tmp_path / "b"), options, None)
    assert first.engine_id != second.engine_id


def test_a_source_without_a_tokenizer_is_refused_by_name(tmp_path):
    """gptq-sequential calibrates on text: a source without a tokenizer is a BuildError saying
    so, also where no other calibration asked for the tokenizer first."""
    from tests.conftest import build_tiny_hf_model

    source = str(tmp_path / "src")
    build_tiny_hf_model("llama-gqa", source)  # no tokenizer files
    options = BuildOptions(dtype="float32", quantization="fp8-dynamic",
                           weight_rounding="gptq-sequential", accuracy_check=False)  # fmt: skip
    with pytest.raises(BuildError, match=r"gptq-sequential.*no tokenizer"):
        build_engine(source, str(tmp_path / "out"), options, None)
