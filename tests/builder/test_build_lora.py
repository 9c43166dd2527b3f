"""`kiln build --lora PATH`: an engine with a PEFT adapter merged into its weights answers as
Hugging Face's PEFT `merge_and_unload()` of the same adapter does (fp32, CPU); its manifest and id
record the adapter's bytes; a bad adapter is one line."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.lora_merge import read_adapter
from kiln.checkpoint.engine_dir import MANIFEST_FILE
from kiln.cli.main import main
from kiln.errors import BuildError
from tests.conftest import build_tiny_hf_model
from tests.peft_adapters import ALL_LINEAR, hf_greedy, save_adapter

PROMPTS = [[1, 5, 9, 33, 7], [1, 200, 3, 17]]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
_ENGINE_ARGS = dict(kv_cache_memory_gb=0.05, max_num_seqs=4)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("src") / "llama")
    build_tiny_hf_model("llama-gqa", path)
    return path


@pytest.fixture(scope="module")
def adapter(source, tmp_path_factory):
    """(its directory, the greedy tokens of PEFT's merge_and_unload() of it)."""
    path = str(tmp_path_factory.mktemp("adapter") / "lora")
    model = save_adapter(source, path, ALL_LINEAR, rank=4, alpha=8, use_rslora=True, scale=4.0)
    return path, hf_greedy(model.merge_and_unload(), PROMPTS, MAX_TOKENS)


def test_a_merged_engine_generates_what_peft_merge_and_unload_does(source, adapter, tmp_path):
    path, want = adapter
    out = str(tmp_path / "engine")
    build_engine(source, out, BuildOptions(lora=path), None)
    base = LLM(source, **_ENGINE_ARGS).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in base] != want  # the adapter changes the answer
    got = LLM(out, **_ENGINE_ARGS).generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want

    with open(os.path.join(out, MANIFEST_FILE)) as f:
        manifest = json.load(f)
    entry = manifest["lora_adapter"]
    assert entry["name"] == "lora" and entry["blake2b"] == read_adapter(path).digest
    assert entry["rank"] == 4 and entry["use_rslora"] is True and entry["modules"] == 14
    assert manifest["source"] == "llama"  # the base's name, not the merged copy's
    assert not [n for n in os.listdir(tmp_path) if ".lora-" in n]  # the merged copy is gone


def test_the_adapter_s_bytes_name_the_engine(source, adapter, tmp_path):
    """Another adapter (or none) is another engine; the same bytes elsewhere are the same."""
    path, _ = adapter
    copy = str(tmp_path / "moved")
    shutil.copytree(path, copy)
    cache = str(tmp_path / "cache")
    first = build_engine(source, None, BuildOptions(lora=path), cache)
    again = build_engine(source, None, BuildOptions(lora=copy), cache)
    assert again.engine_id == first.engine_id
    plain = build_engine(source, None, BuildOptions(), cache)
    assert plain.engine_id != first.engine_id and plain.lora_adapter is None
    other = str(tmp_path / "other")
    save_adapter(source, other, ["q_proj", "v_proj"], seed=1)
    assert build_engine(source, None, BuildOptions(lora=other), cache).engine_id not in (
        first.engine_id,
        plain.engine_id,
    )


def _rewrite_config(path: str, **changes) -> None:
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda p: os.remove(os.path.join(p, "adapter_model.safetensors")), "no adapter_model"),
        (lambda p: os.remove(os.path.join(p, "adapter_config.json")), "no adapter_config.json"),
        (lambda p: _rewrite_config(p, use_dora=True), "DoRA"),
        (lambda p: _rewrite_config(p, modules_to_save=["lm_head"]), "modules_to_save"),
    ],
)
def test_a_bad_adapter_is_one_line(source, adapter, tmp_path, damage, says):
    bad = str(tmp_path / "bad")
    shutil.copytree(adapter[0], bad)
    damage(bad)
    with pytest.raises(BuildError, match=says):
        build_engine(source, str(tmp_path / "e"), BuildOptions(lora=bad), None)


def test_an_adapter_of_another_model_is_refused(source, tmp_path):
    """Shapes the base does not have, and a target module it lacks, name the module."""
    wide = str(tmp_path / "wide")
    build_tiny_hf_model("llama-gqa", wide)
    with open(os.path.join(wide, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] *= 2
    other = str(tmp_path / "other-base")
    os.makedirs(other)
    with open(os.path.join(other, "config.json"), "w") as f:
        json.dump(config, f)
    import transformers

    transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(other)
    ).save_pretrained(other)
    adapter_dir = str(tmp_path / "mlp")
    save_adapter(other, adapter_dir, ["down_proj"])
    with pytest.raises(BuildError, match="down_proj"):
        build_engine(source, str(tmp_path / "e"), BuildOptions(lora=adapter_dir), None)

    renamed = str(tmp_path / "renamed")
    shutil.copytree(adapter_dir, renamed)
    from safetensors.torch import load_file, save_file

    file = os.path.join(renamed, "adapter_model.safetensors")
    tensors = {k.replace("down_proj", "fc9"): v for k, v in load_file(file).items()}
    save_file(tensors, file)
    with pytest.raises(BuildError, match="fc9, which the base model does not have"):
        build_engine(source, str(tmp_path / "e2"), BuildOptions(lora=renamed), None)


def test_kiln_build_takes_lora(source, adapter, tmp_path, capsys):
    out = str(tmp_path / "engine")
    assert main(["build", source, "-o", out, "--lora", adapter[0]]) == 0
    with open(os.path.join(out, MANIFEST_FILE)) as f:
        assert json.load(f)["lora_adapter"]["name"] == "lora"
    assert main(["build", source, "-o", str(tmp_path / "x"), "--lora", str(tmp_path)]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_the_accuracy_check_measures_against_the_merged_model(
    source, adapter, tmp_path, monkeypatch
):
    """A quantized build's reference (and calibration source) is the base with the adapter
    merged: the "source" the check measures answers as PEFT's merged model does."""
    import kiln.builder.accuracy as accuracy

    measured: dict[str, list[list[int]]] = {}

    def measure(llm, max_length, label="model"):
        outs = llm.generate(PROMPTS, GREEDY)
        measured[label] = [o.outputs[0].token_ids for o in outs]
        return {"word_perplexity": 10.0, "token_perplexity": 5.0}

    monkeypatch.setattr(accuracy, "measure", measure)
    options = BuildOptions(lora=adapter[0], dtype="float32", quantization="fp8-dynamic")
    manifest = build_engine(source, str(tmp_path / "fp8"), options, None)
    assert manifest.accuracy["checked"] is True and manifest.lora_adapter is not None
    assert measured["source"] == adapter[1]
