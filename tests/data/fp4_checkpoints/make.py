"""Makes the FP4 test checkpoints on a tiny random Llama, on the CPU.

    PYTHONPATH=<a target dir with llmcompressor 0.14, compressed-tensors 0.19, transformers
    5.17> python tests/data/fp4_checkpoints/make.py

nvfp4/, mxfp4/: llm-compressor's `oneshot` (QuantizationModifier) with its NVFP4A16 scheme
(compressed-tensors `nvfp4-pack-quantized`: e2m1 nibbles packed two to a byte, an fp8 e4m3 scale
per 16 inputs, an fp32 global scale per tensor) and its MXFP4A16 scheme (`mxfp4-pack-quantized`:
e2m1 nibbles, an e8m0 power-of-two scale per 32 inputs), lm_head left out, saved compressed.
modelopt_nvfp4/: NVIDIA ModelOpt's NVFP4 export layout (hf_quant_config.json quant_algo NVFP4;
`weight` uint8, `weight_scale` e4m3 per 16, `weight_scale_2` = 1 / the global scale), written
here from nvfp4/'s tensors, since ModelOpt's NVFP4 export needs a GPU.
<name>_dequantized.safetensors: each projection's weight dequantized in fp32 by
compressed-tensors' own unpack_fp4_from_uint8 + dequantize (for ModelOpt: scale * scale_2, as
vLLM's ModelOpt NVFP4 method), the oracle of the bit-exact dequantization tests. Small by design,
committed, so CI needs none of the tools. The vocabulary fits tests/tiny_tokenizer.py, which a
build test adds to a copy (a build calibrates and scores text).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip


def source() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).float()


def llm_compressor(name: str, scheme: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    with tempfile.TemporaryDirectory() as tmp:  # oneshot reads the model's own directory
        source().save_pretrained(tmp)
        model = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        oneshot(model=model, recipe=recipe)
        model.save_pretrained(os.path.join(HERE, name), save_compressed=True)
    _reference(name)


def _reference(name: str) -> None:
    """Every projection's weight as compressed-tensors dequantizes it, in fp32."""
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    t = load_file(os.path.join(HERE, name, "model.safetensors"))
    with open(os.path.join(HERE, name, "config.json")) as f:
        weights = json.load(f)["quantization_config"]["config_groups"]["group_0"]["weights"]
    args = QuantizationArgs(**weights)
    out = {}
    for prefix in [k.removesuffix(".weight_packed") for k in t if k.endswith("weight_packed")]:
        packed = t[f"{prefix}.weight_packed"]
        m, n = packed.shape
        q = unpack_fp4_from_uint8(packed, m, 2 * n, dtype=torch.float32)
        scale = t[f"{prefix}.weight_scale"]
        scale = decompress_mx_scale(scale) if scale.dtype == torch.uint8 else scale
        gs = t.get(f"{prefix}.weight_global_scale")
        out[f"{prefix}.weight"] = dequantize(
            x_q=q, scale=scale.float(), global_scale=gs, args=args, dtype=torch.float32
        ).contiguous()
    save_file(out, os.path.join(HERE, f"{name}_dequantized.safetensors"))


def modelopt_nvfp4() -> None:
    """nvfp4/'s codes and group scales in ModelOpt's names, its global scale inverted."""
    t = load_file(os.path.join(HERE, "nvfp4", "model.safetensors"))
    out, ref = {}, {}
    for name, tensor in t.items():
        prefix, _, kind = name.rpartition(".")
        if kind == "weight_packed":
            out[f"{prefix}.weight"] = tensor
        elif kind == "weight_global_scale":
            out[f"{prefix}.weight_scale_2"] = (1.0 / tensor.float()).reshape(())
        else:  # weight_scale (e4m3) and every unquantized tensor
            out[name] = tensor
    for prefix in [k.removesuffix(".weight_scale_2") for k in out if k.endswith("scale_2")]:
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

        packed = out[f"{prefix}.weight"]
        q = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], torch.float32)
        scale = out[f"{prefix}.weight_scale"].float() * out[f"{prefix}.weight_scale_2"]
        ref[f"{prefix}.weight"] = (q * scale.repeat_interleave(16, 1)).contiguous()
    target = os.path.join(HERE, "modelopt_nvfp4")
    os.makedirs(target)
    save_file(out, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, os.path.join(HERE, "modelopt_nvfp4_dequantized.safetensors"))
    with open(os.path.join(HERE, "nvfp4", "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    quant = {"producer": {"name": "modelopt", "version": "0.39.0"},
             "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                              "group_size": 16, "exclude_modules": ["lm_head"]}}  # fmt: skip
    with open(os.path.join(target, "hf_quant_config.json"), "w") as f:
        json.dump(quant, f, indent=2)


def nvfp4() -> None:
    llm_compressor("nvfp4", "NVFP4A16")


def mxfp4() -> None:
    llm_compressor("mxfp4", "MXFP4A16")


if __name__ == "__main__":
    for name in sys.argv[1:] or ["nvfp4", "mxfp4", "modelopt_nvfp4"]:
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
        globals()[name]()
        print("made", name)
