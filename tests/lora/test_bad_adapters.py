"""Adapters kiln cannot serve get one line naming the adapter and what is wrong, and the engine
serves the next request as before."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kiln import LLM, LoRAError, LoRARequest, SamplingParams
from tests.lora.adapters import ALL_SEVEN, AdapterSpec, build_adapter, build_base

PROMPT = [1, 5, 9, 33, 70, 12]
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-adapters")
    base = build_base("llama-gqa", str(root / "base"))
    build_adapter(base, AdapterSpec("good", 4, 8, ALL_SEVEN), str(root / "good"), seed=1)
    build_adapter(base, AdapterSpec("big", 16, 16, ["q_proj"]), str(root / "rank16"), seed=2)
    wide = build_base("qwen2-bias", str(root / "other-base"))  # same sizes, other family
    build_adapter(wide, AdapterSpec("x", 4, 8, ["q_proj"]), str(root / "other"), seed=3)
    return root


@pytest.fixture(scope="module")
def llm(root) -> LLM:
    return LLM(str(root / "base"), enable_lora=True, max_loras=2, max_lora_rank=8)


def _edited(root, name: str, edit) -> str:
    """A copy of the good adapter with its adapter_config.json edited by `edit`."""
    path = str(root / name)
    if not os.path.isdir(path):
        shutil.copytree(root / "good", path)
        config_file = os.path.join(path, "adapter_config.json")
        with open(config_file) as f:
            config = json.load(f)
        edit(config)
        with open(config_file, "w") as f:
            json.dump(config, f)
    return path


def _shapes_off(root) -> str:
    """An adapter whose q_proj B has the wrong number of rows."""
    from safetensors.torch import load_file, save_file

    path = str(root / "shapes")
    if not os.path.isdir(path):
        shutil.copytree(root / "good", path)
        file = os.path.join(path, "adapter_model.safetensors")
        tensors = load_file(file)
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
        tensors[key] = tensors[key][:-8].contiguous()
        save_file(tensors, file)
    return path


def _no_weights(root) -> str:
    path = str(root / "pickled")
    if not os.path.isdir(path):
        shutil.copytree(root / "good", path)
        os.rename(
            os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
        )
    return path


def _extra_layer(root) -> str:
    """A layer index past the base model's two layers."""
    from safetensors.torch import load_file, save_file

    path = str(root / "deeper")
    if not os.path.isdir(path):
        shutil.copytree(root / "good", path)
        file = os.path.join(path, "adapter_model.safetensors")
        tensors = load_file(file)
        for half in "AB":
            old = f"base_model.model.model.layers.1.self_attn.q_proj.lora_{half}.weight"
            tensors[old.replace("layers.1", "layers.7")] = tensors[old].clone()
        save_file(tensors, file)
    return path


BAD = {
    "missing": (lambda root: str(root / "nowhere"), "no such directory"),
    "rank": (lambda root: str(root / "rank16"), "rank 16 is over max_lora_rank=8"),
    "shapes": (_shapes_off, r"layers.0.q_proj is \[56 x 64\], the base model's is \[64 x 64\]"),
    "pickle": (_no_weights, "adapter_model.bin is a pickle"),
    "layer": (_extra_layer, "targets layers.7.q_proj, but the base model has no layers.7"),
    "lm_head": (
        lambda root: _edited(root, "head", lambda c: c.update(target_modules=["lm_head"])),
        "targets lm_head, which the base model has no LoRA layer for",
    ),
    "dora": (lambda root: _edited(root, "dora", lambda c: c.update(use_dora=True)), "DoRA"),
    "saved": (
        lambda root: _edited(root, "saved", lambda c: c.update(modules_to_save=["lm_head"])),
        "modules_to_save",
    ),
    "bias": (lambda root: _edited(root, "bias", lambda c: c.update(bias="all")), "bias='all'"),
    "config": (
        lambda root: _edited(root, "noconfig", lambda c: c.update(peft_type="IA3")),
        "peft_type 'IA3' is not LORA",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_one_line_and_serving_goes_on(root, llm: LLM, case: str) -> None:
    make_path, message = BAD[case]
    bad = LoRARequest(f"bad-{case}", 90, make_path(root))
    with pytest.raises(LoRAError, match=message) as error:
        llm.generate([PROMPT], PARAMS, lora_request=bad)
    assert "\n" not in str(error.value) and bad.lora_name in str(error.value)
    assert 90 not in llm.engine.list_loras()
    good = LoRARequest("good", 1, str(root / "good"))
    outs = llm.generate([PROMPT, PROMPT], PARAMS, lora_request=[good, None])
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_an_adapter_trained_on_another_base_with_equal_shapes_loads(root, llm: LLM) -> None:
    """Shapes are what kiln can check: a same-shaped adapter of another base loads."""
    assert llm.engine.add_lora(LoRARequest("other", 5, str(root / "other")))
    assert llm.engine.remove_lora(5)


def test_ids_and_names_are_not_reused(root, llm: LLM) -> None:
    llm.engine.add_lora(LoRARequest("good", 1, str(root / "good")))
    with pytest.raises(LoRAError, match="LoRA id 1 is already adapter 'good'"):
        llm.engine.add_lora(LoRARequest("other", 1, str(root / "other")))
    with pytest.raises(LoRAError, match="LoRA name 'good' is already adapter id 1"):
        llm.engine.add_lora(LoRARequest("good", 2, str(root / "good")))
    with pytest.raises(LoRAError, match="lora_int_id must be an int >= 1"):
        LoRARequest("zero", 0, str(root / "good"))


def test_an_engine_without_lora_refuses_adapters(root) -> None:
    llm = LLM(str(root / "base"))
    with pytest.raises(LoRAError, match="enable_lora=True"):
        llm.generate([PROMPT], PARAMS, lora_request=LoRARequest("good", 1, str(root / "good")))
    assert llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids


def test_lora_request_list_must_match_prompts(root, llm: LLM) -> None:
    from kiln import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="got 1 LoRA requests for 2 prompts"):
        llm.generate([PROMPT, PROMPT], PARAMS, lora_request=[None])


def test_beam_search_with_an_adapter_is_refused(root, llm: LLM) -> None:
    from kiln import InvalidRequestError

    beams = SamplingParams(max_tokens=4, use_beam_search=True, best_of=2)
    good = LoRARequest("good", 1, str(root / "good"))
    with pytest.raises(InvalidRequestError, match="beam search with a LoRA adapter"):
        llm.generate([PROMPT], beams, lora_request=good)
