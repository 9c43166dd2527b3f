"""Makes the pre-quantized 8-bit test checkpoints on a tiny random Llama, on the CPU.

    PYTHONPATH=<a target dir with llmcompressor 0.14, compressed-tensors 0.19, transformers
    5.17> python tests/data/eight_bit_checkpoints/make.py

Each ct_* directory is llm-compressor's `oneshot` (QuantizationModifier, round to nearest, lm_head
left out) saved compressed, as compressed-tensors writes it:
ct_fp8_block/: FP8_BLOCK (float8 weights with one scale per 128x128 block, activations per
token-group of 128 at run time; `float-quantized`); ct_w8a8_int8/: W8A8 (int8 weights per
channel, symmetric; int8 activations per token at run time; `int-quantized`); ct_w8a16_int8/:
W8A16 (int8 weights in groups of 128, weight-only; `pack-quantized`, four codes a word);
ct_w8a16_int8_channel/: the same per channel; ct_w8a16_fp8/: float8 weights per channel,
weight-only (`float-quantized`).
fp8_block_hf/: the DeepSeek-V3 / Qwen3 FP8 release format (`quant_method: fp8`,
`weight_block_size: [128, 128]`, `weight_scale_inv`), written here from ct_fp8_block's codes and
scales (the same values; transformers reads this format itself, dequantizing on the CPU).
The source is bf16, as released models are (so are most scales). The hidden size, 256, gives
the projections two blocks of inputs; k/v's 64 rows are a partial block. Weights drawn at
0.1 (not transformers' 0.02) so that greedy tokens vary rather than repeat.
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
    vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
    rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1,
)  # fmt: skip


def source() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16)


def llm_compressor(name: str, scheme: object) -> None:
    import tempfile

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    with tempfile.TemporaryDirectory() as tmp:  # oneshot reads the model's own directory
        source().save_pretrained(tmp)
        model = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16)
        if isinstance(scheme, str):
            recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        else:
            recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
        oneshot(model=model, recipe=recipe)
        model.save_pretrained(os.path.join(HERE, name), save_compressed=True)
    _check_ct(name)


def _check_ct(name: str) -> None:
    """compressed-tensors' own decompression (through transformers, run_compressed off) equals
    the tests' reading of the layout, rounded to the dtype it decompresses to."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
    from tests.checkpoint.test_eight_bit_checkpoints import dequantized_state

    path = os.path.join(HERE, name)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    ours = dequantized_state(path)
    for key, value in model.state_dict().items():
        if key.endswith("proj.weight"):
            assert torch.equal(value, ours[key].to(value.dtype)), key


def ct_fp8_block() -> None:
    llm_compressor("ct_fp8_block", "FP8_BLOCK")


def ct_w8a8_int8() -> None:
    llm_compressor("ct_w8a8_int8", "W8A8")


def ct_w8a16_int8() -> None:
    llm_compressor("ct_w8a16_int8", "W8A16")


def ct_w8a16_int8_channel() -> None:
    weights = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
    llm_compressor("ct_w8a16_int8_channel", dict(targets=["Linear"], weights=weights))


def ct_w8a16_fp8() -> None:
    weights = dict(num_bits=8, type="float", symmetric=True, strategy="channel")
    llm_compressor("ct_w8a16_fp8", dict(targets=["Linear"], weights=weights))


def fp8_block_hf() -> None:
    """ct_fp8_block's codes and block scales in the DeepSeek / Qwen FP8 release layout."""
    src, out = os.path.join(HERE, "ct_fp8_block"), os.path.join(HERE, "fp8_block_hf")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    state = {}
    for key, value in tensors.items():
        if key.endswith("proj.weight_scale"):
            state[key.removesuffix("weight_scale") + "weight_scale_inv"] = value.float()
        else:
            state[key] = value
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(
        quant_method="fp8", activation_scheme="dynamic", fmt="e4m3",
        weight_block_size=[128, 128], modules_to_not_convert=["lm_head"],
    )  # fmt: skip
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    which = sys.argv[1:] or ["ct_fp8_block", "ct_w8a8_int8", "ct_w8a16_int8",
                             "ct_w8a16_int8_channel", "ct_w8a16_fp8", "fp8_block_hf"]  # fmt: skip
    for name in which:
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
        globals()[name]()
        print("made", name)
