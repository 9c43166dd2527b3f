"""Mixture-of-experts checkpoints in FP8 with 128x128 block scales, as users have them, against
Hugging Face on the checkpoint dequantized in fp32. A tiny Qwen3-MoE made with transformers is
written in Qwen's and DeepSeek's FP8 release format here (`quant_method: fp8`,
`weight_block_size: [128, 128]`: every projection, the experts' too, float8 e4m3 with
`weight_scale_inv` = a block's absmax / 448; the routers left out, as Qwen's list them in
modules_to_not_convert). The oracle is transformers' Qwen3-MoE on the dequantized weights with
each projection's input rounded as kiln's run time rounds it: per token-group of 128 inputs to
float8, the experts' inputs on steps of more than 16 tokens only (fewer take the weight-only
decode GEMVs). Teacher-forced on kiln's greedy tokens, each is the oracle's greedy choice or a
near-tie of it and the logprobs are close, alone and batched, several times closer than to the
unrounded model (check_against says why not token for token); the experts' codes and scales
load as written; a float8 router is widened; `kiln build --quantization
fp8-block` and `quantization="fp8-block"` on the fp32 checkpoint round the experts to the
same format."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import LLM, SamplingParams
from kiln.layers.moe import MAX_DECODE_TOKENS
from kiln.models.moe_config import expert_scale_count
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf

Rounding = Callable[[torch.Tensor], torch.Tensor]
TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
ARGS = dict(dtype="float32", block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=4, device="cpu")
# Every prompt longer than MAX_DECODE_TOKENS: its prefill runs the grouped GEMM alone or batched.
PROMPTS = [[1, *range(40, 60)], [1, *range(100, 133)], [1, *range(7, 58)]]
# hidden 128 (one input block); 8 heads of 32 (o_proj's 256 inputs), experts and the dense MLP
# 256 wide: two blocks, one per rank at TP=2; k_proj's 64 rows a partial row block.
QWEN3_MOE = dict(hidden_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                 num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True, head_dim=32,
                 num_attention_heads=8, num_key_value_heads=2, intermediate_size=256)  # fmt: skip


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen's FP8 format, written from its definition: float8 e4m3 codes of w / s, s =
    absmax / 448 of each 128x128 block ([rows / 128, in / 128], the last blocks partial)."""
    rows, k = w.shape
    rb, kb = -(-rows // 128), -(-k // 128)
    padded = torch.zeros(rb * 128, kb * 128)
    padded[:rows, :k] = w.float()
    blocks = padded.view(rb, 128, kb, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(rb * 128, kb * 128)
    return codes[:rows, :k].contiguous(), scale


def dequantize_block(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, k = codes.shape
    return codes.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :k]


def write_fp8_release(src: str, dst: str, quantize_routers: bool = False) -> None:
    """`src`'s checkpoint in the FP8 release format at `dst` (every `*_proj.weight`; the routers
    too with `quantize_routers`), and its dequantized twin at `dst`-dequantized."""
    with safe_open(str(Path(src) / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        router = name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))
        mixtral_expert = re.search(r"\.experts\.\d+\.w[123]\.weight$", name) is not None
        if name.endswith("_proj.weight") or mixtral_expert or (router and quantize_routers):
            codes, scale = quantize_block(tensor)
            quantized[name], quantized[f"{name}_scale_inv"] = codes, scale
            dequantized[name] = dequantize_block(codes, scale)
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((Path(src) / "config.json").read_text())
    layers = range(config["num_hidden_layers"])
    mlp = "block_sparse_moe" if config["model_type"] == "mixtral" else "mlp"
    routers = [] if quantize_routers else [f"model.layers.{i}.{mlp}.gate" for i in layers]
    for out, tensors, declared in ((dst, quantized, True), (f"{dst}-dequantized", dequantized,
                                                              False)):  # fmt: skip
        shutil.copytree(src, out)
        save_file(tensors, str(Path(out) / "model.safetensors"))
        quantization = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", *routers],
        }  # fmt: skip
        written = {**config, "quantization_config": quantization} if declared else config
        (Path(out) / "config.json").write_text(json.dumps(written))


def fp8_groups(x: torch.Tensor) -> torch.Tensor:
    """x rounded as DeepSeek-V3's activations: per token-group of 128 to float8 and back."""
    k = x.shape[-1]
    g = torch.nn.functional.pad(x.float(), (0, -k % 128)).unflatten(-1, (-1, 128))
    scale = (g.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * scale).flatten(-2)[..., :k]


def fp8_tokens(x: torch.Tensor) -> torch.Tensor:
    """x rounded as FP8 W8A8's dynamic activations: per token (row) to float8 and back."""
    scale = (x.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _rounded_experts(experts: torch.nn.Module, always: bool, rounding: Rounding):
    """transformers' Qwen3MoeExperts.forward with its inputs rounded as kiln's kernels round
    them: per group of 128 on steps of more than MAX_DECODE_TOKENS tokens, weight-only below
    (`always`: at every size, as expert-parallel ranks run)."""

    def forward(hidden_states, top_k_index, top_k_weights):
        rounded = always or hidden_states.shape[0] > MAX_DECODE_TOKENS
        r = rounding if rounded else (lambda t: t)
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == expert)
            gate_up = torch.nn.functional.linear(
                r(hidden_states[token]), experts.gate_up_proj[expert]
            )
            gate, up = gate_up.chunk(2, dim=-1)
            act = experts.act_fn(gate) * up
            down = torch.nn.functional.linear(r(act), experts.down_proj[expert])
            out.index_add_(0, token, down * top_k_weights[token, slot, None])
        return out

    return forward


def oracle(
    path: str, always_rounded: bool = False, rounding: Rounding | None = None
) -> torch.nn.Module:
    """transformers' Qwen3-MoE on `path`-dequantized in fp32, inputs rounded as kiln's
    (`rounding`, per group of 128 by default; `always_rounded`: the experts' at every step
    size, as under expert parallelism)."""
    import transformers

    r = rounding or fp8_groups
    model = transformers.AutoModelForCausalLM.from_pretrained(
        f"{path}-dequantized", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for name, module in model.named_modules():
        if name.endswith("_proj") and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args: (r(args[0]),))
        if type(module).__name__ in ("Qwen3MoeExperts", "MixtralExperts"):
            module.forward = _rounded_experts(module, always_rounded, r)
    return model


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("qwen3_moe_fp8")
    src, dst = str(root / "src"), str(root / "fp8")
    save_tiny_hf(src, "qwen3_moe", "Qwen3MoeForCausalLM", perturb=perturb_norms_and_biases,
                 **QWEN3_MOE)  # fmt: skip
    write_fp8_release(src, dst)
    return src, dst, oracle(dst)


def teacher_forced_gaps(
    model: torch.nn.Module, outs: list
) -> tuple[torch.Tensor, torch.Tensor]:  # (|logprob gaps|, the model's margins) per token
    """`model` fed kiln's completions `outs` a step at a time as kiln ran them (the prompt,
    then one token a step): for each token, |kiln's logprob - the model's| and how far it falls
    below the model's greedy choice (0: it is that choice)."""
    gaps, margins = [], []
    with torch.no_grad():
        for out in outs:
            cache, step = None, torch.tensor([out.prompt_token_ids])
            for i, token in enumerate(out.outputs[0].token_ids):
                result = model(step, past_key_values=cache, use_cache=True)
                cache, step = result.past_key_values, torch.tensor([[token]])
                logprobs = torch.log_softmax(result.logits[0, -1], -1)
                gaps.append(abs(logprobs[token].item() - out.outputs[0].logprobs[i][token].logprob))
                margins.append((logprobs.max() - logprobs[token]).item())
    return torch.tensor(gaps), torch.tensor(margins)


def check_against(model: torch.nn.Module, llm: LLM, prompts: list[list[int]]) -> list:
    """kiln's greedy tokens and logprobs against `model` teacher-forced on them. Float8
    activations make the two runs' fp32 noise (thread counts and summation orders differ) flip
    a few codes, a float8 step being 1/8 of a value, which a tiny random model amplifies (over
    48 tokens a median logprob gap of 0.011, the largest 0.26; a single prompt's median up to
    0.05; against the unrounded model 0.12): each token must be the model's greedy choice or
    within a near-tie of it (0.3 of logprob, measured 0.15 at most), most of them exactly it,
    the logprobs close. Returns the outputs."""
    outs = llm.generate(prompts, GREEDY)
    gap, margin = teacher_forced_gaps(model, outs)
    assert margin.max() < 0.3 and (margin == 0).float().mean() >= 0.6, margin
    assert gap.median() < 0.1 and gap.max() < 0.6, gap
    return outs


def test_the_fp8_release_format_equals_hf_dequantized(release) -> None:
    _, path, model = release
    llm = LLM(path, **ARGS)
    experts = llm.engine.executor.runner.model.layers[0].mlp.experts
    assert type(experts.method).__name__ == "Fp8BlockMoEMethod"
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_weight_scale.shape == (4, 512, 1)  # each row's scale of each 128 inputs
    assert experts.w2_weight_scale.shape == (4, 128, 2)
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        up = f.get_tensor("model.layers.0.mlp.experts.2.up_proj.weight")
        up_scale = f.get_tensor("model.layers.0.mlp.experts.2.up_proj.weight_scale_inv")
    assert torch.equal(experts.w13_weight[2, 256:].view(torch.uint8), up.view(torch.uint8))
    assert torch.equal(experts.w13_weight_scale[2, 256:], up_scale.repeat_interleave(128, 0))
    layers = llm.engine.executor.runner.model.layers
    sparse = [layer.mlp.experts for layer in layers if hasattr(layer.mlp, "experts")]
    planned = expert_scale_count(llm.engine.executor.runner.model.config, "fp8-block")
    assert [e.w13_weight_scale.numel() + e.w2_weight_scale.numel() for e in sparse] == [
        planned
    ] * 2  # what the build's memory plan counts
    outs = check_against(model, llm, PROMPTS)  # batched
    # The rounding is kiln's: the unrounded model is several times farther.
    unrounded = oracle(path, rounding=lambda t: t)
    assert teacher_forced_gaps(model, outs)[0].median() * 3 < (
        teacher_forced_gaps(unrounded, outs)[0].median()
    )
    for prompt in PROMPTS[:2]:  # alone (not token for token the batched run: its codes flip too)
        check_against(model, llm, [prompt])


def test_a_quantized_router_is_widened(release, tmp_path) -> None:
    src, _, _ = release
    path = str(tmp_path / "fp8")
    write_fp8_release(src, path, quantize_routers=True)
    llm = LLM(path, **ARGS)
    assert llm.engine.executor.runner.model.layers[0].mlp.gate.weight.dtype == torch.float32
    check_against(oracle(path), llm, PROMPTS[:2])


def _same_parameters(a: LLM, b: LLM) -> None:
    pa = dict(a.engine.executor.runner.model.named_parameters())
    pb = dict(b.engine.executor.runner.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name, param in pa.items():
        other = pb[name]
        assert param.dtype == other.dtype, name
        if param.element_size() == 1:
            param, other = param.view(torch.uint8), other.view(torch.uint8)
        assert torch.equal(param, other), name


def test_fp8_block_quantizes_the_experts_of_a_full_precision_checkpoint(release, tmp_path):
    """Online and built: every projection, the experts too, rounded per 128x128 block as the
    release format is written here (the same codes and scales), so the same model."""
    from kiln.builder.build import BuildOptions, build_engine

    src, path, model = release
    released = LLM(path, **ARGS)
    online = LLM(src, quantization="fp8-block", **ARGS)
    _same_parameters(online, released)
    out = str(tmp_path / "engine")
    build_engine(src, out, BuildOptions(dtype="float32", quantization="fp8-block",
                                        accuracy_check=False, max_model_len=256), None)  # fmt: skip
    built = LLM(out, **ARGS)
    assert built.engine.executor.runner.model.layers[2].mlp.experts.w2_weight_scale.shape == (
        4, 128, 2,
    )  # fmt: skip
    _same_parameters(built, released)
    check_against(model, built, PROMPTS[:1])


def test_a_mixtral_release_with_one_block_per_expert(tmp_path) -> None:
    """Mixtral's expert names (w1 / w2 / w3, whose weight_scale_inv keep their name) and
    experts of one 128x128 block each (hidden 64, width 32: every scale [1, 1])."""
    from tests.models.test_moe import FAMILIES

    model_type, architecture, overrides = FAMILIES["mixtral"]
    src, path = str(tmp_path / "src"), str(tmp_path / "fp8")
    save_tiny_hf(src, model_type, architecture, perturb=perturb_norms_and_biases, **overrides)
    write_fp8_release(src, path)
    llm = LLM(path, **ARGS)
    experts = llm.engine.executor.runner.model.layers[1].mlp.experts
    assert experts.w13_weight_scale.shape == (4, 64, 1) and experts.w2_weight_scale.shape == (
        4, 64, 1,
    )  # fmt: skip
    check_against(oracle(path), llm, PROMPTS)
