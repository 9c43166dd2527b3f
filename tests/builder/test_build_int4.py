"""`kiln build --quantization int4-gptq | int4-awq` on a tiny random Llama with a tokenizer: the
engine holds the Int4LinearMethod layout (groups of 128 with zero points), loads and runs close to
its source, and its manifest records the check; AWQ's factors are folded into the norms."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.int4 import group_size
from kiln.errors import BuildError
from kiln.layers.quantization.int4 import Int4LinearMethod
from kiln.models.config import ModelConfig
from tests.tiny_tokenizer import build_tokenizer

ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=4)
PROMPTS = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17, 44, 90, 12]]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    """hidden 128 (groups of 128), GQA, a tokenizer (the build calibrates and scores text)."""
    path = str(tmp_path_factory.mktemp("int4-src") / "llama")
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def _forced_logprobs(llm: LLM, sequences: list[list[int]]) -> torch.Tensor:
    one = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate(sequences, one)
    return torch.tensor(
        [next(iter(d.values())).logprob for o in out for d in o.prompt_logprobs[1:]]
    )


@pytest.mark.parametrize("scheme", ["int4-gptq", "int4-awq"])
def test_an_int4_build_loads_as_int4_and_runs_close_to_its_source(scheme, source, tmp_path):
    engine = str(tmp_path / "engine")
    manifest = build_engine(source, engine, BuildOptions(quantization=scheme), None)
    assert manifest.quantization == "int4-g128"
    assert manifest.accuracy["checked"] and manifest.accuracy["passed"], manifest.accuracy
    assert manifest.accuracy["max_ppl_increase_pct"] == 25.0  # INT4's default under 1B
    llm, src = LLM(engine, **ARGS), LLM(source, **ARGS)
    model = llm.engine.executor.runner.model
    for proj in (model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.down_proj):
        assert isinstance(proj.method, Int4LinearMethod) and proj.method.group_size == 128
        assert proj.weight.dtype == torch.int32 and proj.weight_scales.shape[1] == (
            proj.in_features // 128
        )
        assert proj.weight_zeros.min() >= 0 and proj.weight_zeros.max() <= 15
    norm = model.layers[0].input_layernorm
    src_norm = src.engine.executor.runner.model.layers[0].input_layernorm
    # AWQ divides the norm by its factors (folded); GPTQ leaves it as it is.
    assert torch.equal(norm, src_norm) == (scheme == "int4-gptq")
    # The source's greedy continuation scores alike (random weights: near-uniform logits).
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = src.generate(PROMPTS, greedy)
    forced = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outputs)]
    diff = (_forced_logprobs(llm, forced) - _forced_logprobs(src, forced)).abs().max()
    assert 0 < diff < 0.1, diff


def test_group_size_falls_back_to_64_for_smollm2_shapes() -> None:
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 1,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 64,
    })  # fmt: skip
    assert group_size(cfg) == 64


def test_int4_refuses_float8_only_options() -> None:
    with pytest.raises(BuildError, match=r"smoothing 'smoothquant:0\.3' is not supported"):
        BuildOptions(quantization="int4-awq", smoothing="smoothquant")
    with pytest.raises(BuildError, match="weight_rounding 'gptq' is not supported"):
        BuildOptions(quantization="int4-gptq", weight_rounding="gptq")


def test_a_build_on_the_relaid_path_writes_the_same_engine(source, tmp_path, monkeypatch):
    """Building where the sm_90 kernel runs (forced here): the rounded layers re-lay their codes
    after loading and keep only that copy, and the writer puts them back, byte for byte."""
    from kiln.checkpoint.engine_dir import MANIFEST_FILE
    from kiln.layers.quantization import int4

    def files(directory):  # the manifest differs only in its build time and date
        return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*")
                if p.is_file() and p.name != MANIFEST_FILE}  # fmt: skip

    options = BuildOptions(quantization="int4-gptq")
    plain = build_engine(source, str(tmp_path / "plain"), options, None)
    relaid: list[int] = []
    monkeypatch.setattr(int4, "relays_codes", lambda device, k, group: relaid.append(k) or True)
    again = build_engine(source, str(tmp_path / "relaid"), options, None)
    assert relaid  # the build's model went through the relay
    assert again.engine_id == plain.engine_id and again.accuracy == plain.accuracy
    weights = files(tmp_path / "relaid")
    assert weights == files(tmp_path / "plain")
    assert any(p.suffix == ".safetensors" for p in weights)
