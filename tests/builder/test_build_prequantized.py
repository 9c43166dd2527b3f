"""`kiln build` from the pre-quantized FP8 checkpoints the real tools made
(tests/data/fp8_checkpoints: llm-compressor's FP8_DYNAMIC, ModelOpt's FP8 with KV scales): the
engine carries the checkpoint's float8 bytes and scales as the loader fuses them, answers as the
checkpoint loaded directly does, records where its quantization came from, and a --quantization
that contradicts the checkpoint is a one-line error. Also the kernel tile record of the manifest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.manifest import EngineManifest
from kiln.builder.tiles import CPU_REASON, describe, kernel_tiles
from kiln.checkpoint.engine_dir import MANIFEST_FILE
from kiln.cli.main import main
from kiln.errors import BuildError, ModelLoadError
from kiln.models.config import PRESETS, ModelConfig
from tests.conftest import assert_same_completions

DATA = Path(__file__).parents[1] / "data" / "fp8_checkpoints"
PROMPTS = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=4)
SCHEMES = {
    "compressed_tensors": ("fp8-dynamic", "compressed-tensors"),
    "modelopt": ("fp8", "modelopt"),
}


@pytest.fixture(scope="session")
def prequant_engines(tmp_path_factory) -> dict[str, str]:
    """Each test checkpoint built once with the defaults (--quantization auto)."""
    root = tmp_path_factory.mktemp("prequant-engines")
    out = {}
    for name in SCHEMES:
        out[name] = str(root / name)
        build_engine(str(DATA / name), out[name], BuildOptions(), None)
    return out


def _manifest(engine: str) -> dict:
    with open(os.path.join(engine, MANIFEST_FILE)) as f:
        return json.load(f)


def _tensors(path: str | Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_engine_carries_the_checkpoints_float8_bytes_and_scales(name, prequant_engines):
    engine, src = _tensors(prequant_engines[name]), _tensors(DATA / name)
    for layer in range(2):
        hf, ours = f"model.layers.{layer}.", f"layers.{layer}."
        for fused, parts in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
            block = fused.split(".")[0]
            shards = [f"{hf}{block}.{p}_proj" for p in parts]
            want = torch.cat([src[s + ".weight"] for s in shards])
            got = engine[f"{ours}{fused}.weight"]
            assert got.dtype == torch.float8_e4m3fn
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # not re-quantized
            # A per-tensor scale is repeated over its shard's rows, a per-channel one as written.
            scales = [src[s + ".weight_scale"].float().reshape(-1) for s in shards]
            rows = [src[s + ".weight"].shape[0] for s in shards]
            want_scale = torch.cat([sc.expand(r) for sc, r in zip(scales, rows)])
            torch.testing.assert_close(engine[f"{ours}{fused}.weight_scale"], want_scale)
            if name == "modelopt":  # the shards share their input: the largest static scale
                want_input = max(src[s + ".input_scale"].item() for s in shards)
                assert engine[f"{ours}{fused}.input_scale"].item() == want_input
        down = engine[f"{ours}mlp.down_proj.weight"].view(torch.uint8)
        assert torch.equal(down, src[f"{hf}mlp.down_proj.weight"].view(torch.uint8))


@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_engine_answers_as_the_checkpoint_loaded_directly(name, prequant_engines):
    want = LLM(str(DATA / name), **ARGS).generate(PROMPTS, GREEDY)
    got = LLM(prequant_engines[name], **ARGS).generate(PROMPTS, GREEDY)
    assert_same_completions(got, want, atol=1e-6)  # the same arithmetic: fp32 equal


@pytest.mark.parametrize("name", list(SCHEMES))
def test_the_manifest_says_where_the_quantization_came_from(name, prequant_engines):
    manifest = _manifest(prequant_engines[name])
    scheme, fmt = SCHEMES[name]
    assert manifest["quantization"] == scheme
    origin = manifest["quantization_source"]
    assert origin["format"] == fmt and "no re-quantization" in origin["method"]
    if name == "modelopt":
        assert origin["config_file"] == "hf_quant_config.json"
        assert origin["config"]["quantization"]["quant_algo"] == "FP8"
    else:
        assert origin["config"]["quant_method"] == "compressed-tensors"
    accuracy = manifest["accuracy"]
    assert accuracy["checked"] and accuracy["passed"] and accuracy["baseline_is_quantized"]
    assert "pre-quantized checkpoint as kiln loads it directly" in accuracy["baseline"]
    assert accuracy["max_abs_token_logprob_diff"] <= 1e-6 and accuracy["tokens"] > 1000
    assert accuracy["source_token_perplexity"] > 1  # a real perplexity, reported for both
    assert accuracy["engine_token_perplexity"] == pytest.approx(
        accuracy["source_token_perplexity"], rel=1e-6
    )
    if torch.cuda.is_available():  # the GPU's table (the CI runs on the CPU)
        assert manifest["kernel_tiles"]["gpu_class"] == torch.cuda.get_device_name()
    else:
        assert manifest["kernel_tiles"] is None and manifest["kernel_tiles_reason"] == CPU_REASON


def test_modelopt_kv_scales_are_the_engines_and_apply_to_a_float8_cache(prequant_engines, tmp_path):
    src = _tensors(DATA / "modelopt")
    want_scales = [
        [src[f"model.layers.{i}.self_attn.{p}_proj.{p}_scale"].item() for p in "kv"]
        for i in range(2)
    ]
    manifest = _manifest(prequant_engines["modelopt"])
    assert manifest["kv_scales"] == want_scales  # as written (float32 values)
    assert manifest["kv_scales_in_weights"] is False  # built for the model dtype's cache
    # Served with a float8 cache, it folds them in as the checkpoint loaded directly does; an
    # engine built for the float8 cache holds them folded already. All three answer alike.
    fp8 = dict(ARGS, kv_cache_dtype="fp8")
    want = LLM(str(DATA / "modelopt"), **fp8).generate(PROMPTS, GREEDY)
    got = LLM(prequant_engines["modelopt"], **fp8).generate(PROMPTS, GREEDY)
    assert_same_completions(got, want, atol=1e-6)
    folded = str(tmp_path / "kv8")
    options = BuildOptions(kv_cache_dtype="fp8", accuracy_check=False)
    build_engine(str(DATA / "modelopt"), folded, options, None)
    assert _manifest(folded)["kv_scales_in_weights"] is True
    assert _manifest(folded)["kv_scales"] == want_scales
    assert_same_completions(LLM(folded, **ARGS).generate(PROMPTS, GREEDY), want, atol=1e-6)


def _char_tokenizer(path: Path) -> None:
    """A character tokenizer that fits the test checkpoints' 256-token vocabulary."""
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(path))


def test_a_float8_cache_the_checkpoint_has_no_scales_for(tmp_path):
    """Without a tokenizer the cache stays unscaled, as loading the checkpoint leaves it (the
    same arithmetic: checked against it); with one, the build calibrates k/v scales into the
    weights and checks them against the checkpoint's model-dtype cache, within the 1% limit."""
    options = BuildOptions(kv_cache_dtype="fp8")
    plain = build_engine(str(DATA / "compressed_tensors"), str(tmp_path / "plain"), options, None)
    assert plain.kv_scales is None and plain.quantization_source["kv_scales"] is None
    assert plain.accuracy["passed"] and plain.accuracy["max_ppl_increase_pct"] == 0.01
    src = tmp_path / "with-tokenizer"
    shutil.copytree(DATA / "compressed_tensors", src)
    _char_tokenizer(src)
    built = build_engine(str(src), str(tmp_path / "calibrated"), options, None)
    assert len(built.kv_scales) == 2 and built.kv_scales_in_weights
    assert built.quantization_source["kv_scales"].startswith("calibrated at build time")
    accuracy = built.accuracy
    assert accuracy["passed"] and "model-dtype KV cache" in accuracy["baseline"]
    assert accuracy["metric"] == "word_perplexity" and accuracy["max_ppl_increase_pct"] == 1.0
    assert accuracy["source_word_perplexity"] != accuracy["engine_word_perplexity"]
    qkv = _tensors(tmp_path / "calibrated")["layers.0.self_attn.qkv_proj.weight"]
    src_q = _tensors(src)["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(qkv[: len(src_q)].view(torch.uint8), src_q.view(torch.uint8))


@pytest.mark.parametrize(
    ("name", "quantization", "message"),
    [
        ("modelopt", "fp8-dynamic", "static per-tensor input scales .*would re-quantize it"),
        ("compressed_tensors", "fp8", "dynamic per-token .*would re-quantize it"),
        ("compressed_tensors", "none", "does not dequantize them"),
    ],
)
def test_a_quantization_that_contradicts_the_checkpoint_is_refused(
    name, quantization, message, tmp_path, capsys
):
    with pytest.raises(BuildError, match=message):
        build_engine(str(DATA / name), str(tmp_path / "e"), BuildOptions(quantization), None)
    argv = ["build", str(DATA / name), "-o", str(tmp_path / "e"), "--quantization", quantization]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "e")


def test_a_prequantized_build_is_cached_by_content(tmp_path, monkeypatch, capsys):
    cache = str(tmp_path / "cache")
    src = str(DATA / "compressed_tensors")
    argv = ["build", src, "-o", str(tmp_path / "a"), "--cache-dir", cache, "--no-accuracy-check"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    want = (
        "kernel tiles ("
        if torch.cuda.is_available()
        else f"kernel tiles: none recorded ({CPU_REASON})"
    )
    assert want in printed
    first = EngineManifest.read(str(tmp_path / "a"))

    def no_load(*args, **kwargs):
        raise AssertionError("a cached engine must not load its source")

    monkeypatch.setattr("kiln.builder.build.find_model_source", no_load)
    # Its scheme named explicitly is the same build as "auto": the same engine, from the cache.
    options = BuildOptions(dtype="float32", quantization="fp8-dynamic", accuracy_check=False)
    second = build_engine(src, str(tmp_path / "b"), options, cache)
    assert second == first
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert a.keys() == b.keys()
    assert all(
        torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)) for k in a
    )


def test_the_kernel_tiles_recorded_for_an_h200_build(monkeypatch, capsys):
    """The table that applies on a GPU, computed as the kernels compute it (here with the H200's
    132 SMs on a fake CUDA device: only the device type and the SM count are read)."""
    from kiln.kernels.triton import small_batch_tiles

    monkeypatch.setattr(small_batch_tiles, "num_sms", lambda device: 132)
    cfg = ModelConfig.from_hf_dict(PRESETS["llama-3.1-8b"])
    cuda = torch.device("cuda")
    tiles, reason = kernel_tiles(
        cfg, "fp8", torch.bfloat16, torch.float8_e4m3fn, cuda, "NVIDIA H200"
    )
    assert reason is None and tiles["gpu_class"] == "NVIDIA H200" and tiles["num_sms"] == 132
    entries = {(e["projection"], e["rows"]): e for e in tiles["small_batch_linear"]}
    qkv = entries["qkv_proj", "1"]
    assert (qkv["kernel"], qkv["n"], qkv["k"], qkv["from"]) == (
        "qkv_rotary",
        6144,
        4096,
        "measured",
    )
    assert (
        qkv["tiles"]
        == small_batch_tiles.MEASURED_TILES["qkv_rotary", 6144, 4096, 1, True]._asdict()
    )
    assert entries["down_proj", "2-8"]["tiles"]["split_k"] == 4
    assert entries["gate_up_proj", "1"]["from"] == "measured"
    want = small_batch_tiles.tile_config("norm_linear_silu_mul", 28672, 4096, cuda, 1, 1)
    assert entries["gate_up_proj", "1"]["tiles"] == want._asdict()
    assert entries["qkv_proj", "2-8"]["from"] == "rule"  # no measured entry: the rule's choice
    want = small_batch_tiles.tile_config("linear", 6144, 4096, cuda, 1, 8)
    assert entries["qkv_proj", "2-8"]["tiles"] == want._asdict()
    attn = tiles["decode_attention"]
    assert (attn["block_n"], attn["num_warps"], attn["num_stages"]) == (64, 4, 2)  # float8 cache
    bf16, _ = kernel_tiles(cfg, "none", torch.bfloat16, torch.bfloat16, cuda, "NVIDIA H200")
    assert bf16["small_batch_linear"][0]["element_bytes"] == 2
    assert bf16["decode_attention"]["num_stages"] == 3
    text = describe(tiles, None)
    assert "NVIDIA H200" in text and "split-k 4 (measured)" in text and "decode attention" in text
    assert kernel_tiles(cfg, "fp8", torch.float32, torch.float32, torch.device("cpu"), None) == (
        None,
        CPU_REASON,
    )


def test_a_scheme_kiln_cannot_carry_is_refused_by_name(tmp_path):
    """An int4 compressed-tensors checkpoint: the loader's one-line error, before any weight."""
    src = tmp_path / "int4"
    shutil.copytree(DATA / "compressed_tensors", src)
    config = json.loads((src / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights.update(type="int", num_bits=4, strategy="group", group_size=128)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="int4/group weights"):
        build_engine(str(src), str(tmp_path / "e"), BuildOptions(), None)
