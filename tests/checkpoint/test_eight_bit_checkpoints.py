"""8-bit checkpoints as the tools write them (tests/data/eight_bit_checkpoints/make.py:
llm-compressor's FP8_BLOCK, W8A8 INT8, W8A16 INT8 and float8 weight-only, and the DeepSeek / Qwen
FP8 release format) load into kiln's 8-bit methods and generate the same greedy tokens as the
checkpoint dequantized exactly (here, from each format's documented layout) into a plain
transformers Llama in fp32, its projections' inputs rounded as the scheme rounds activations
(per token to int8; per group of 128 inputs to float8). transformers reads the FP8 release
format itself: its weights are checked to be the ones read here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import LLM, SamplingParams
from kiln.errors import ModelLoadError

DATA = Path(__file__).parents[1] / "data" / "eight_bit_checkpoints"
PROMPTS = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17], [4, 4, 8, 15, 16, 23, 42]]
TOKENS = 24
ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=4, dtype="float32")
# checkpoint -> (kiln's scheme, its method, how the scheme rounds activations)
CHECKPOINTS = {
    "ct_fp8_block": ("fp8-block", "Fp8BlockLinearMethod", "fp8-groups"),
    "fp8_block_hf": ("fp8-block", "Fp8BlockLinearMethod", "fp8-groups"),
    "ct_w8a8_int8": ("int8-w8a8", "Int8LinearMethod", "int8-tokens"),
    "ct_w8a16_int8": ("int8-w8a16-g128", "W8A16LinearMethod", None),
    "ct_w8a16_int8_channel": ("int8-w8a16-channel", "W8A16LinearMethod", None),
    "ct_w8a16_fp8": ("fp8-w8a16-channel", "W8A16LinearMethod", None),
}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _codes(t: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """[out, in] codes as fp32: compressed-tensors packs 8-bit codes + 128 four to an int32,
    code i at bits 8 (i % 4) of word i // 4 (its pack_to_int32)."""
    if f"{prefix}.weight_packed" not in t:
        return t[f"{prefix}.weight"].float()
    words = t[f"{prefix}.weight_packed"].to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(1)
    return (codes - 128).float()


def dequantized_state(path: Path | str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in fp32 with every projection's weight dequantized: code times
    its scale, a [rows / 128, in / 128] scale per 128x128 block, or [rows, groups] per group of
    inputs (one group: per channel)."""
    t = _tensors(Path(path))
    state = {}
    for key, value in t.items():
        if not key.endswith(("proj.weight", "proj.weight_packed")):
            if value.is_floating_point() and "scale" not in key:
                state[key] = value.float()
            continue
        prefix = key.rsplit(".", 1)[0]
        codes = _codes(t, prefix)
        scale = t.get(f"{prefix}.weight_scale", t.get(f"{prefix}.weight_scale_inv"))
        assert scale is not None, prefix
        scale = scale.float()
        rows, k = codes.shape
        if scale.shape[0] != rows:  # 128x128 blocks
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :k]
        else:
            full = scale.repeat_interleave(k // scale.shape[1], 1)
        state[f"{prefix}.weight"] = codes * full
    return state


def _round_inputs(activations: str | None):
    """A forward pre-hook rounding a projection's input as the scheme's run time does."""

    def int8_tokens(x: torch.Tensor) -> torch.Tensor:
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
        return torch.round(x / scale).clamp(-127, 127) * scale

    def fp8_groups(x: torch.Tensor) -> torch.Tensor:
        g = x.unflatten(-1, (-1, 128))
        scale = (g.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
        q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        return (q * scale).flatten(-2)

    rounding = {"int8-tokens": int8_tokens, "fp8-groups": fp8_groups}[activations]
    return lambda module, args: (rounding(args[0]),)


def _generate(model, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    # No end of sequence, as kiln's ignore_eos: generate's min_new_tokens would instead forbid
    # the EOS token, which kiln may pick.
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
            out.append(ids[0, len(prompt) :].tolist())
    return out


def _hf_model(name: str, state: dict[str, torch.Tensor] | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = DATA / name
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    model.load_state_dict(dequantized_state(path) if state is None else state, strict=True)
    activations = CHECKPOINTS[name][2]
    if activations is not None:
        for module_name, module in model.named_modules():
            if module_name.endswith("_proj"):
                module.register_forward_pre_hook(_round_inputs(activations))
    return model


@pytest.fixture(scope="module")
def oracle() -> dict[str, list[list[int]]]:
    return {}


def _want(oracle: dict, name: str) -> list[list[int]]:
    if name not in oracle:
        oracle[name] = _generate(_hf_model(name), PROMPTS)
    return oracle[name]


def _kiln(path: Path | str, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), **{**ARGS, **kwargs})
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_an_eight_bit_checkpoint_generates_the_dequantized_models_tokens(name, oracle) -> None:
    scheme, method, _ = CHECKPOINTS[name]
    llm = LLM(str(DATA / name), **ARGS)
    assert scheme in llm.engine.executor.facts.description
    layer = llm.engine.executor.runner.model.layers[1]
    for proj in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        assert type(proj.method).__name__ == method
        assert proj.weight.element_size() == 1  # the 8-bit codes, not widened
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    alone = [list(llm.generate([p], greedy)[0].outputs[0].token_ids) for p in PROMPTS]
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
    want = _want(oracle, name)
    assert len({t for row in want for t in row}) > 10  # the oracle's tokens are not degenerate
    assert alone == want
    assert batched == want


def test_transformers_reads_the_fp8_release_format_as_the_oracle_does() -> None:
    """transformers' own FP8 loader (weight_scale_inv per 128x128 block, dequantized on a CPU)
    gives the weights this file's reading of the layout gives."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DATA / "fp8_block_hf"), dtype=torch.float32)
    ours = dequantized_state(DATA / "fp8_block_hf")
    theirs = model.state_dict()
    for key in [k for k in ours if k.endswith("proj.weight")]:
        torch.testing.assert_close(theirs[key].float(), ours[key], rtol=0, atol=0)


def _edited(tmp_path: Path, name: str, config_edit=None, tensor_edit=None) -> Path:
    path = tmp_path / name
    shutil.copytree(DATA / name, path)
    if config_edit is not None:
        config = json.loads((path / "config.json").read_text())
        config_edit(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    if tensor_edit is not None:
        tensors = _tensors(path)
        tensor_edit(tensors)
        save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    ("name", "suffix"),
    [("ct_fp8_block", "weight_scale"), ("fp8_block_hf", "weight_scale_inv"),
     ("ct_w8a16_int8", "weight_scale")],
)  # fmt: skip
def test_scales_read_in_another_order_change_the_tokens(tmp_path, oracle, name, suffix) -> None:
    """The block (or group) scales of every down_proj with their input blocks swapped: were
    kiln reading one scale for a whole row, it could not tell."""

    def swap(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith(f"down_proj.{suffix}")]:
            tensors[key] = tensors[key].flip(1).contiguous()

    assert _kiln(_edited(tmp_path, name, tensor_edit=swap)) != _want(oracle, name)


def test_int8_activations_are_rounded_per_token(oracle) -> None:
    """The oracle without its activation rounding is another model: kiln matches the rounded one
    (the parametrized test), so its W8A8 rounds its activations."""
    unrounded = _hf_model("ct_w8a16_int8_channel", dequantized_state(DATA / "ct_w8a8_int8"))
    assert _generate(unrounded, PROMPTS) != _want(oracle, "ct_w8a8_int8")


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("fp8_block_hf", lambda q: q.update(weight_block_size=[64, 64]), r"\[64, 64\]"),
        ("fp8_block_hf", lambda q: q.update(activation_scheme="static"), "static"),
        ("fp8_block_hf", lambda q: q.update(fmt="e5m2"), "e5m2"),
        ("fp8_block_hf", lambda q: q.update(modules_to_not_convert=["layers.0.mlp"]), "mlp"),
        ("ct_w8a8_int8",
         lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False),
         "asymmetric"),
        ("ct_w8a8_int8",
         lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False,
                                                                            strategy="tensor"),
         "W8A8"),
        ("ct_fp8_block",
         lambda q: q["config_groups"]["group_0"]["weights"].update(block_structure=[128, 64]),
         "FP8_BLOCK"),
        ("ct_w8a16_int8", lambda q: q.update(ignore=[]), "lm_head"),
        ("ct_w8a16_int8",
         lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"),
         "actorder"),
    ],
)  # fmt: skip
def test_what_kiln_cannot_load_is_refused(tmp_path, name, edit, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(_edited(tmp_path, name, edit)), **ARGS)


def test_a_checkpoint_missing_its_scales_is_refused(tmp_path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.1.mlp.up_proj.weight_scale"]

    with pytest.raises(ModelLoadError, match=r"up_proj\.weight_scale"):
        LLM(str(_edited(tmp_path, "ct_w8a8_int8", tensor_edit=drop)), **ARGS)


def _round_to_nearest(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """w [rows, in] dequantized after rounding to nearest: per row to int8 (absmax / 127), or
    per 128x128 block (the last rows' partial) to float8 (absmax / 448)."""
    if scheme.startswith("int8"):  # int8-w8a8 and int8-w8a16-channel: the same weights
        scale = w.abs().amax(1, keepdim=True) / 127
        return torch.round(w / scale).clamp(-127, 127) * scale
    rows = w.shape[0]
    padded = torch.nn.functional.pad(w, (0, 0, 0, -rows % 128))
    blocks = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # inputs are whole here
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / 448
    q = (blocks / scale).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(2).flatten(0, 1)[:rows]


@pytest.mark.parametrize(
    ("scheme", "like"),
    [("int8-w8a8", "ct_w8a8_int8"), ("fp8-block", "ct_fp8_block"),
     ("int8-w8a16-channel", "ct_w8a16_int8_channel")],
)  # fmt: skip
def test_dummy_and_16_bit_weights_round_to_the_scheme_as_they_load(tmp_path, scheme, like) -> None:
    """quantization="int8-w8a8" / "fp8-block" / "int8-w8a16-channel": dummy weights for
    benchmarks, and a 16-bit checkpoint rounded to nearest as it loads: the tokens of
    transformers' model with its weights rounded so here and its activations as the scheme
    rounds them."""
    dummy = LLM(str(DATA / like), load_format="dummy", quantization=scheme, **ARGS)
    down = dummy.engine.executor.runner.model.layers[0].mlp.down_proj
    assert down.weight.element_size() == 1 and bool((down.weight.float() != 0).any())
    dummy.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0))
    _hf_model("ct_w8a16_int8").save_pretrained(tmp_path / "plain")  # no hooks: weight-only
    rounded = LLM(str(tmp_path / "plain"), quantization=scheme, **ARGS)
    assert rounded.engine.executor.runner.model.layers[0].mlp.down_proj.weight.element_size() == 1
    state = {
        k: _round_to_nearest(v, scheme) if k.endswith("proj.weight") else v
        for k, v in dequantized_state(DATA / "ct_w8a16_int8").items()
    }
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in rounded.generate(PROMPTS, greedy)]
    assert got == _generate(_hf_model(like, state), PROMPTS)


def test_a_grouped_int8_mixture_of_experts_checkpoint_is_refused(tmp_path) -> None:
    """Block FP8 experts load (tests/models/test_moe_fp8_block.py), per-channel 8-bit ones too
    (tests/models/test_moe_w8a16.py), in groups of 128 too; W8A16 in groups of 64 is refused."""

    def groups_of_64(q: dict) -> None:
        q["config_groups"]["group_0"]["weights"]["group_size"] = 64

    path = _edited(tmp_path, "ct_w8a16_int8", config_edit=groups_of_64)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=64)  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"int8-w8a16-g64.*mixture-of-experts"):
        LLM(str(path), **ARGS)


def test_symmetric_zero_points_written_as_zeros_are_skipped(tmp_path, oracle) -> None:
    """Older compressed-tensors versions wrote a symmetric scheme's zero points (all zero):
    they load as if absent; a nonzero one is refused."""

    def zeros(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith("proj.weight_scale")]:
            tensors[key.replace("weight_scale", "weight_zero_point")] = torch.zeros(
                tensors[key].shape, dtype=torch.int8
            )

    assert _kiln(_edited(tmp_path, "ct_w8a8_int8", tensor_edit=zeros)) == _want(
        oracle, "ct_w8a8_int8"
    )

    def one(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.mlp.up_proj.weight_zero_point"] = torch.ones(
            256, 1, dtype=torch.int8
        )

    with pytest.raises(ModelLoadError, match="nonzero zero points"):
        _kiln(_edited(tmp_path / "one", "ct_w8a8_int8", tensor_edit=one))
