"""Makes the pre-quantized INT4 (W4A16) test checkpoints on a tiny random Llama, on the CPU.

    PYTHONPATH=<a target dir with llmcompressor 0.14, compressed-tensors 0.19, transformers
    5.17> python tests/data/int4_checkpoints/make.py

ct_g128/, ct_g128_asym/, ct_channel/: llm-compressor's `oneshot` (QuantizationModifier, round to
nearest) with the W4A16 (symmetric, group 128), W4A16_ASYM (zero points) and a per-channel
symmetric int4 scheme, lm_head left out, saved compressed (compressed-tensors `pack-quantized`).
gptq/, gptq_desc_act/: GPTQ's checkpoint layout (AutoGPTQ / GPTQModel `checkpoint_format`
"gptq", v1: qweight [in/8, out] packed along the input, qzeros [groups, out/8] holding zero - 1,
scales [groups, out] fp16, g_idx [in]) written here, since GPTQModel needs a CUDA torch: group 128
symmetric in input order (gptq_channel/: per channel, group_size -1), and group 64 asymmetric
with `desc_act` (each input's group from a permutation, shared by the projections reading one
input, as GPTQ's act-order gives). awq/:
AutoAWQ's GEMM layout (qweight [in, out/8] and qzeros [groups, out/8] packed in AWQ's interleaved
order 0,2,4,6,1,3,5,7, scales [groups, out] fp16; zero points, group 64) written here, checked
against compressed-tensors' own AutoAWQ reader. The weights are rounded to nearest (no GPTQ / AWQ
search): the tests check the layouts, not the tools' rounding. Small by design, committed, so CI
needs none of the tools.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
# Projections reading one input share GPTQ's act-order permutation (one Hessian).
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}  # fmt: skip
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column at bits 4i of AutoAWQ's GEMM int32


def source() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).float()


def llm_compressor(name: str, scheme: object) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # oneshot reads the model's own directory
        source().save_pretrained(tmp)
        model = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        _oneshot(model, name, scheme)


def _oneshot(model: LlamaForCausalLM, name: str, scheme: object) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if isinstance(scheme, str):
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    else:
        recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(os.path.join(HERE, name), save_compressed=True)
    _check_ct(name)


def _check_ct(name: str) -> None:
    """compressed-tensors' own unpack + dequantize equals the tests' reading of the layout."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
    from tests.checkpoint.test_int4_checkpoints import _dequantize

    t = load_file(os.path.join(HERE, name, "model.safetensors"))
    with open(os.path.join(HERE, name, "config.json")) as f:
        weights = json.load(f)["quantization_config"]["config_groups"]["group_0"]["weights"]
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size")
    args = QuantizationArgs(**{k: v for k, v in weights.items() if k in keys})
    for prefix in [k.removesuffix(".weight_packed") for k in t if k.endswith("weight_packed")]:
        shape = torch.Size(t[f"{prefix}.weight_shape"].tolist())
        scale, zp = t[f"{prefix}.weight_scale"], t.get(f"{prefix}.weight_zero_point")
        q = unpack_from_int32(t[f"{prefix}.weight_packed"], 4, shape)
        if zp is not None:
            zp = unpack_from_int32(zp, 4, torch.Size((shape[0], scale.shape[1])), packed_dim=0)
        want = dequantize(x_q=q, scale=scale, zero_point=zp, args=args).float()
        assert torch.equal(want, _dequantize(name, t, prefix, {})), prefix


def ct_g128() -> None:
    llm_compressor("ct_g128", "W4A16")


def ct_g128_asym() -> None:
    llm_compressor("ct_g128_asym", "W4A16_ASYM")


def ct_channel() -> None:
    weights = dict(num_bits=4, type="int", symmetric=True, strategy="channel")
    llm_compressor("ct_channel", dict(targets=["Linear"], weights=weights))


def rtn(w: torch.Tensor, sym: bool, g_idx: torch.Tensor):
    """Codes [out, in] in 0..15, scales and zeros [out, groups], as AutoGPTQ's quantizer rounds
    (symmetric: zero 8, scale 2 absmax / 15); column k uses group g_idx[k]."""
    groups = int(g_idx.max()) + 1
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            hi = torch.maximum(-lo, hi)
            scales[:, g], zeros[:, g] = 2 * hi / 15, 8
        else:
            scales[:, g] = (hi - lo) / 15
            zeros[:, g] = torch.round(-lo / scales[:, g])
    scales = scales.half().float()  # the checkpoint's fp16 scales are what the codes use
    s, z = scales[:, g_idx], zeros[:, g_idx]
    codes = torch.clamp(torch.round(w / s) + z, 0, 15).to(torch.int32)
    return codes, scales, zeros.to(torch.int32)


def pack(codes: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[rows, cols] codes -> [rows, cols/8] int32, column 8j + order[i] at bits 4i of word j."""
    c = codes.reshape(codes.shape[0], -1, 8)[:, :, list(order)].to(torch.int64)
    word = sum(c[:, :, i] << (4 * i) for i in range(8))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def quantized_checkpoint(name: str, group: int, sym: bool, desc_act: bool, awq: bool) -> None:
    model = source()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    perms: dict[str, torch.Tensor] = {}
    for layer in range(CONFIG["num_hidden_layers"]):
        for proj in PROJS:
            prefix = f"model.layers.{layer}.{proj}"
            w = state.pop(f"{prefix}.weight")
            k = w.shape[1]
            g_idx = torch.arange(k) // group if group > 0 else torch.zeros(k, dtype=torch.int64)
            if desc_act:  # act-order: column perm[i] is the i-th quantized, in group i // group
                key = f"{layer}.{INPUT_OF[proj.split('.')[1]]}"
                perm = perms.setdefault(key, torch.randperm(k, generator=gen))
                g_idx = torch.empty(k, dtype=torch.int64)
                g_idx[perm] = torch.arange(k) // group
            codes, scales, zeros = rtn(w, sym, g_idx)
            if awq:
                state[f"{prefix}.qweight"] = pack(codes.t().contiguous(), AWQ_ORDER)
                state[f"{prefix}.qzeros"] = pack(zeros.t().contiguous(), AWQ_ORDER)
            else:
                state[f"{prefix}.qweight"] = pack(codes).t().contiguous()
                state[f"{prefix}.qzeros"] = pack((zeros - 1).t().contiguous())
                state[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
            state[f"{prefix}.scales"] = scales.t().contiguous().half()
    out = os.path.join(HERE, name)
    model.config.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    if awq:
        quant = dict(quant_method="awq", bits=4, group_size=group, zero_point=not sym,
                     version="gemm", modules_to_not_convert=None)  # fmt: skip
    else:
        quant = dict(quant_method="gptq", bits=4, group_size=group, sym=sym, desc_act=desc_act,
                     checkpoint_format="gptq", true_sequential=True, damp_percent=0.01)  # fmt: skip
    config["quantization_config"] = quant
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def gptq() -> None:
    quantized_checkpoint("gptq", 128, sym=True, desc_act=False, awq=False)


def gptq_channel() -> None:
    quantized_checkpoint("gptq_channel", -1, sym=True, desc_act=False, awq=False)


def gptq_desc_act() -> None:
    quantized_checkpoint("gptq_desc_act", 64, sym=False, desc_act=True, awq=False)


def awq() -> None:
    quantized_checkpoint("awq", 64, sym=False, desc_act=False, awq=True)
    # compressed-tensors' AutoAWQ reader (an independent decoder) must read the same weights.
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    tensors = load_file(os.path.join(HERE, "awq", "model.safetensors"))
    prefix = "model.layers.0.mlp.up_proj"
    want = _dequant_awq(tensors, prefix)
    reader = AutoAWQConverter.__new__(AutoAWQConverter)
    reader.bits, reader.zero_point = 4, True
    iw, iz = reader.unpack_awq(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], 4)
    iw, iz = reader.reverse_awq_order(iw, iz, 4)
    iw, iz = (iw & 15).float(), (iz & 15).float()
    scales = tensors[f"{prefix}.scales"].float()
    got = ((iw - iz.repeat_interleave(64, 0)) * scales.repeat_interleave(64, 0)).t()
    assert torch.equal(got, want), "compressed-tensors reads the AWQ layout otherwise"


def _dequant_awq(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    words = tensors[f"{prefix}.qweight"].to(torch.int64) & 0xFFFFFFFF
    zwords = tensors[f"{prefix}.qzeros"].to(torch.int64) & 0xFFFFFFFF
    inv = [AWQ_ORDER.index(c) for c in range(8)]
    codes = torch.stack([(words >> (4 * inv[c])) & 15 for c in range(8)], -1).flatten(1)
    zeros = torch.stack([(zwords >> (4 * inv[c])) & 15 for c in range(8)], -1).flatten(1)
    scales = tensors[f"{prefix}.scales"].float()
    g = torch.arange(codes.shape[0]) // (codes.shape[0] // scales.shape[0])
    return ((codes - zeros[g]).float() * scales[g]).t()


if __name__ == "__main__":
    which = sys.argv[1:] or ["ct_g128", "ct_g128_asym", "ct_channel", "gptq", "gptq_channel",
                             "gptq_desc_act", "awq"]  # fmt: skip
    for name in which:
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
        globals()[name]()
        print("made", name)
