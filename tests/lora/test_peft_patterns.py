"""Per-module alpha and rank (PEFT's alpha_pattern and rank_pattern): each module's B @ A as
the adapter reader scales it equals PEFT's own delta weight, for the engine's reader and the
build's merge alike; and the engine's greedy tokens are HF + PEFT's (fp32, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln import LLM, LoRARequest, SamplingParams
from kiln.builder.lora_merge import read_adapter
from kiln.lora.peft import read_peft_adapter
from tests.lora.adapters import ALL_SEVEN, build_base, hf_greedy

PROMPTS = [[1, 5, 9, 33, 70, 12], [1, 200, 3, 4]]
MAX_TOKENS = 8
# A short name matching every layer's module, a full one matching one layer's, and ranks.
ALPHAS = {"q_proj": 32, "model.layers.1.mlp.down_proj": 2, "up_proj": 40}
RANKS = {"v_proj": 2, "gate_proj": 6, "model.layers.0.self_attn.o_proj": 8}


def _peft_model(base, path: str, rslora: bool):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=ALL_SEVEN, use_rslora=rslora,
        alpha_pattern=ALPHAS, rank_pattern=RANKS, init_lora_weights=False,
    )  # fmt: skip
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "rslora"])
def made(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("patterns")
    base = build_base("llama-gqa", str(root / "base"))
    model = _peft_model(base, str(root / "adapter"), request.param)
    return str(root / "base"), str(root / "adapter"), model


def _peft_deltas(model) -> dict[str, torch.Tensor]:
    """PEFT's delta weight (scaling * B @ A) of every LoRA layer, by the base's module name."""
    deltas = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            deltas[name.removeprefix("base_model.model.")] = module.get_delta_weight(
                "default"
            ).detach()
    return deltas


def test_each_module_is_scaled_as_peft_scales_it(made) -> None:
    _, path, model = made
    want = _peft_deltas(model)
    assert len(want) == 14 and len({float(d.norm()) for d in want.values()}) == 14
    served = read_peft_adapter("p", path).modules
    merged = read_adapter(path).matrices
    assert served[(0, "v_proj")].rank == 2 and served[(0, "o_proj")].rank == 8
    for name, delta in want.items():
        index, proj = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        for module in (served[(index, proj)], merged[name]):
            got = module.lora_b @ module.lora_a
            torch.testing.assert_close(got, delta.float(), rtol=1e-5, atol=1e-6)


def test_greedy_tokens_equal_peft(made) -> None:
    base_path, path, model = made
    llm = LLM(base_path, enable_lora=True, max_loras=1, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, lora_request=LoRARequest("p", 1, path))
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS
    ]
