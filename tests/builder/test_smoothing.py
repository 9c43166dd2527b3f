"""SmoothQuant smoothing (kiln.builder.calibrate.smoothing, `kiln build --smoothing`): exact without
quantization (HF transformers and kiln's own engine as oracles), named in the manifest and the
engine id, refused where it cannot apply, and better FP8 accuracy on a model with outliers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.calibrate.smoothing import (
    KINDS,
    SmoothingSpec,
    smooth_checkpoint,
    smoothing_factors,
)
from kiln.errors import BuildError
from kiln.llm import LLM
from kiln.models.llama import LlamaForCausalLM
from kiln.runtime.model_loader import find_model_source
from kiln.sampling_params import SamplingParams
from tests.conftest import (
    assert_same_completions,
    build_tiny_hf_model,
    teacher_forced_logprobs,
)

DATA = Path(__file__).parents[1] / "data" / "fp8_checkpoints"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7], [1, 200, 3, 17]]


def _outlier_amax(model: LlamaForCausalLM, seed: int) -> dict[str, torch.Tensor]:
    """Per-channel input amax with a few channels 100x the rest: factors far from 1."""
    gen = torch.Generator().manual_seed(seed)
    amax = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in KINDS:
            a = torch.rand(module.in_features, generator=gen) + 0.5
            a[torch.randperm(module.in_features, generator=gen)[:3]] *= 100.0
            amax[name] = a
    return amax


def _kiln_model(path: str) -> LlamaForCausalLM:
    source = find_model_source(path, "auto")
    model = LlamaForCausalLM(source.config, 64, dtype=torch.float32)
    model.load_weights(source.weights)
    return model


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])  # GQA 4/2; v's bias too
def test_a_smoothed_checkpoint_computes_what_the_source_does(variant, tmp_path):
    hf = build_tiny_hf_model(variant, str(tmp_path))
    model = _kiln_model(str(tmp_path))
    factors = smoothing_factors(model, _outlier_amax(model, seed=1), alpha=0.5)
    assert all(float(s.max() / s.min()) > 5.0 for s in factors.values())  # far from uniform
    state = hf.state_dict()
    smoothed = dict(smooth_checkpoint(state.items(), factors, model.config))
    changed = [n for n in state if not torch.equal(state[n], smoothed[n])]
    assert any("input_layernorm" in n for n in changed) and any("v_proj" in n for n in changed)
    assert not any("embed" in n or n == "model.norm.weight" for n in changed)
    ids = torch.tensor([[1, 5, 9, 33, 7, 200, 3, 17, 60, 61]])
    with torch.no_grad():
        want = hf(ids).logits
        hf.load_state_dict(smoothed)
        got = hf(ids).logits
    assert (got - want).abs().max() < 1e-5


LAYER_NORM_VARIANTS = {
    # StableLM 2 1.6B: biased LayerNorms before each block (weights and biases divided).
    "stablelm": ("stablelm", "StableLmForCausalLM", dict(use_qkv_bias=True)),
    # StableLM 2 12B: one biased LayerNorm before parallel blocks, per-head q/k LayerNorms.
    "stablelm-parallel": ("stablelm", "StableLmForCausalLM",
                          dict(use_parallel_residual=True, qk_layernorm=True)),
    # Command R: one LayerNorm without bias before parallel blocks, q/k rows reordered at load.
    "cohere": ("cohere", "CohereForCausalLM", dict(use_qk_norm=True, logit_scale=0.25)),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(LAYER_NORM_VARIANTS))
def test_layer_norm_families_smooth_exactly(variant, tmp_path):
    """The LayerNorm families: the factors fold into the norm's weight and bias; a parallel
    layer's one norm takes one factor for its attention and MLP."""
    from kiln.config import EngineConfig
    from kiln.runtime.model_loader import load_model
    from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf

    model_type, architecture, overrides = LAYER_NORM_VARIANTS[variant]
    hf = save_tiny_hf(str(tmp_path), model_type, architecture,
                      perturb=perturb_norms_and_biases, **overrides)  # fmt: skip
    model = load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"), torch.float32)
    kiln_model = model.model
    factors = smoothing_factors(kiln_model, _outlier_amax(kiln_model, seed=1), alpha=0.5)
    assert all(float(s.max() / s.min()) > 5.0 for s in factors.values())
    parallel = variant != "stablelm"
    layer = "layers.0."
    shared = torch.equal(factors[layer + "self_attn.qkv_proj"], factors[layer + "mlp.gate_up_proj"])
    assert shared == parallel
    state = hf.state_dict()
    smoothed = dict(smooth_checkpoint(state.items(), factors, kiln_model.config))
    changed = {n for n in state if not torch.equal(state[n], smoothed[n])}
    assert "model.layers.0.input_layernorm.weight" in changed
    if model_type == "stablelm":
        assert "model.layers.0.input_layernorm.bias" in changed
    ids = torch.tensor([[1, 5, 9, 33, 7, 200, 3, 17, 60, 61]])
    with torch.no_grad():
        want = hf(ids).logits
        hf.load_state_dict(smoothed)
        got = hf(ids).logits
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


@pytest.fixture(scope="module")
def outlier_source(tmp_path_factory) -> str:
    """The tiny chat Llama (with a tokenizer) with outlier input channels injected at every
    projection kind, each compensated exactly in the weights after it: the same function, but
    activations with a few channels 1e5x the others: past e4m3's range (2^-9..448), so unsmoothed
    the others underflow (per token) and the outliers' weight columns round to zero."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("outliers")))
    file = Path(path) / "model.safetensors"
    t = load_file(str(file))
    k, heads, kv_heads, head_dim = 1e5, 4, 2, 16
    for i in range(2):
        p = f"model.layers.{i}."
        for norm, projs in (
            ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            t[p + norm + ".weight"][[3, 40]] *= k
            for proj in projs:
                t[p + proj + ".weight"][:, [3, 40]] /= k
        t[p + "mlp.up_proj.weight"][[7, 90]] *= k  # down_proj's input channels 7 and 90
        t[p + "mlp.down_proj.weight"][:, [7, 90]] /= k
        t[p + "self_attn.v_proj.weight"][[5]] *= k  # KV head 0, dim 5: query heads 0 and 1
        group = heads // kv_heads
        t[p + "self_attn.o_proj.weight"][:, [h * head_dim + 5 for h in range(group)]] /= k
    save_file(t, str(file), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def fp8_builds(outlier_source, tmp_path_factory):
    """fp8-dynamic builds of the outlier model, unsmoothed and smoothed, both checked."""
    out = tmp_path_factory.mktemp("builds")
    common = dict(quantization="fp8-dynamic", max_ppl_increase=1e6, max_model_len=128)
    plain = build_engine(outlier_source, str(out / "plain"), BuildOptions(**common), None)
    options = BuildOptions(**common, smoothing="smoothquant")
    smooth = build_engine(outlier_source, str(out / "smooth"), options, None)
    return plain, smooth, out


def test_smoothing_brings_the_fp8_error_of_outlier_channels_down(fp8_builds, outlier_source):
    """Per-token logprob error against the unquantized source on held-out text (a tiny random
    model's perplexity moves either way by chance; its per-token error does not)."""
    from kiln.builder.accuracy import HELD_OUT_FILE

    plain, smooth, out = fp8_builds
    assert plain.accuracy["checked"] and smooth.accuracy["checked"]
    with open(HELD_OUT_FILE, encoding="utf-8") as f:
        text = f.read(2000)
    want = teacher_forced_logprobs(outlier_source, text)
    err_plain = (teacher_forced_logprobs(str(out / "plain"), text) - want).abs().mean()
    err_smooth = (teacher_forced_logprobs(str(out / "smooth"), text) - want).abs().mean()
    assert err_plain > 0.3  # the injected outliers cost the plain build
    assert err_smooth < err_plain / 2  # measured 0.61 -> 0.16 (0.14-0.15: fp8 without outliers)


def test_the_manifest_and_the_engine_id_carry_the_smoothing(fp8_builds):
    plain, smooth, out = fp8_builds
    assert smooth.engine_id != plain.engine_id
    assert smooth.smoothing == "smoothquant:0.7" and plain.smoothing == "none"
    assert "SmoothQuant, alpha 0.7" in smooth.scales_method
    assert "SmoothQuant" not in plain.scales_method
    written = json.loads((out / "smooth" / "kiln_engine.json").read_text())
    assert written["smoothing"] == "smoothquant:0.7"
    # The default alpha named or not: one engine (the canonical form names it); per scheme.
    assert BuildOptions(
        dtype="float32", quantization="fp8", smoothing="smoothquant:0.30"
    ).smoothing == (
        BuildOptions(dtype="float32", quantization="fp8", smoothing="smoothquant").smoothing
    )


def test_smoothing_in_place_leaves_the_unquantized_model_as_it_was(outlier_source):
    """The build's source model, smoothed in memory (what the other calibrations then observe),
    answers as before: kiln's own engine, fp32."""
    from kiln.builder.accuracy import CALIBRATION_FILE
    from kiln.builder.quantize import smooth_source

    llm = LLM(outlier_source, dtype="float32", kv_cache_memory_gb=0.05, max_num_seqs=2,
              max_model_len=128, enable_prefix_caching=False)  # fmt: skip
    want = llm.generate(PROMPTS, GREEDY)
    with open(CALIBRATION_FILE, encoding="utf-8") as f:
        text = f.read(20_000)
    factors = smooth_source(llm, outlier_source, text, "smoothquant:0.7")
    norm = llm.engine.executor.runner.model.layers[0].input_layernorm
    assert float(norm.detach().abs().max()) < 1000.0  # the injected 1e5x channels were smoothed
    assert len(factors) == 8
    assert_same_completions(llm.generate(PROMPTS, GREEDY), want, atol=1e-5)


def test_smoothing_where_it_cannot_apply_is_a_clear_error(tiny_hf_source, tmp_path):
    with pytest.raises(BuildError, match="needs --quantization fp8 or fp8-dynamic"):
        BuildOptions(dtype="float32", quantization="none", smoothing="smoothquant")
    with pytest.raises(BuildError, match="needs --quantization fp8 or fp8-dynamic"):
        options = BuildOptions(smoothing="smoothquant")  # "auto" of an unquantized source: none
        build_engine(tiny_hf_source, str(tmp_path / "auto"), options, None)
    with pytest.raises(BuildError, match="quantized already"):
        options = BuildOptions(smoothing="smoothquant:0.4")
        build_engine(str(DATA / "compressed_tensors"), str(tmp_path / "pre"), options, None)
    for bad, says in (("smoothquant:1.5", "in \\[0, 1\\]"), ("smoothquant:x", "a number"),
                      ("awq", "none or smoothquant")):  # fmt: skip
        with pytest.raises(BuildError, match=says):
            BuildOptions(dtype="float32", quantization="fp8", smoothing=bad)
    assert str(SmoothingSpec.parse("none")) == "none"


@pytest.fixture(scope="module")
def tiny_hf_source(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("plain") / "llama")
    build_tiny_hf_model("llama-gqa", path)
    return path


def test_a_tp_build_smooths_whole_tensors_before_the_cut(fp8_builds, outlier_source, tmp_path):
    """-tp 2: each rank's shard is its cut of the TP=1 smoothed engine's tensors (the factors
    come from, and fold into, whole tensors; a row-parallel o_proj / down_proj keeps its
    columns' factors)."""
    from safetensors.torch import load_file

    from kiln.checkpoint.engine_dir import rank_dir_name

    _, smooth, out = fp8_builds
    options = BuildOptions(dtype="float32", quantization="fp8-dynamic", max_model_len=128,
                           smoothing="smoothquant", tensor_parallel_size=2,
                           accuracy_check=False)  # fmt: skip
    sharded = build_engine(outlier_source, str(tmp_path / "tp2"), options, None)
    assert sharded.smoothing == smooth.smoothing and sharded.engine_id != smooth.engine_id

    def tensors(directory: Path) -> dict[str, torch.Tensor]:
        found = {}
        for file in directory.glob("*.safetensors"):
            found.update(load_file(str(file)))
        return found

    whole = tensors(out / "smooth")
    for rank in range(2):
        part = tensors(tmp_path / "tp2" / rank_dir_name(rank, 2))
        for name in ("layers.0.input_layernorm", "layers.1.post_attention_layernorm"):
            assert torch.equal(part[name], whole[name])
        for name in ("layers.0.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
            cols = whole[name].shape[1] // 2
            want = whole[name][:, rank * cols : (rank + 1) * cols]
            assert torch.equal(part[name].view(torch.uint8), want.view(torch.uint8))


def test_unquantized_layers_stay_in_the_model_dtype_and_load_so(outlier_source, tmp_path):
    from safetensors.torch import load_file

    options = BuildOptions(dtype="float32", quantization="fp8", max_model_len=128,
                           accuracy_check=False,
                           unquantized_layers=("layers.1.mlp.*",))  # fmt: skip
    built = build_engine(outlier_source, str(tmp_path / "kept"), options, None)
    assert built.unquantized_layers == ["layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"]
    file = next(n for n in built.files if n.endswith(".safetensors"))
    t = load_file(str(tmp_path / "kept" / file))
    assert t["layers.1.mlp.down_proj.weight"].dtype == torch.float32
    assert "layers.1.mlp.down_proj.weight_scale" not in t
    assert t["layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    llm = LLM(str(tmp_path / "kept"), kv_cache_memory_gb=0.05, max_num_seqs=2)
    mlp = llm.engine.executor.runner.model.layers[1].mlp
    assert mlp.down_proj.weight.dtype == torch.float32
    out = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
    with pytest.raises(BuildError, match="matches no projection"):
        options = BuildOptions(
            dtype="float32", quantization="fp8", unquantized_layers=("layers.*.mlp.up_proj",)
        )
        build_engine(outlier_source, str(tmp_path / "typo"), options, None)
    with pytest.raises(BuildError, match="needs --quantization fp8 or fp8-dynamic"):
        BuildOptions(dtype="float32", quantization="none", unquantized_layers=("layers.0.*",))
